"""The one place trainflow reaches into a library's private or protected internals.

Each entry says what it uses or replaces, why no public API does the job, the upstream issue
(or that none was found), and the versions it was checked against; tests/unit/test_compat.py
fails when an installed version differs or the internals no longer behave as the entry expects.
"""

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SUBMITIT_VERSIONS = ("1.5.4",)
"""submitit versions whose `SlurmJobEnvironment._requeue` `shield_submitit_requeue` replaces."""
DASK_JOBQUEUE_VERSIONS = ("0.9.0",)
"""dask-jobqueue versions whose import `import_slurm_cluster` shields."""
TORCH_FAKE_VERSIONS = ("2.13.0",)
"""torch versions (without the local +cpu/+cu tag) whose FakeTensorMode `fake_forward` uses."""
TRANSFORMERS_FAKE_VERSIONS = ("5.24.0",)
"""transformers versions whose meta-device forward `fake_forward` was checked against."""
MLFLOW_VERSIONS = ("3.17.2",)
"""mlflow versions whose `_use_tracking_uri` `mlflow_tracking_uri` uses."""
TORCH_MKLDNN_VERSIONS = ("2.13.0",)
"""torch versions (without the local tag) whose mkldnn op `mkldnn_bf16_supported` calls."""
MLFLOW_PYTORCH_VERSIONS = ("3.17.2",)
"""mlflow versions whose `mlflow.pytorch` import `import_mlflow_pytorch` keeps Lightning out of."""
DISTRIBUTED_VERSIONS = ("2026.7.1",)
"""distributed versions whose `SpecCluster._correct_state` `start_requested_workers` awaits."""


def shield_submitit_requeue(requeue: Callable[[str], None]) -> None:
    """Have submitit requeue a Slurm job (after SIGUSR2 before a time limit or a preemption)
    through `requeue(job_id)` instead of its own `SlurmJobEnvironment._requeue`.

    Why: submitit runs `subprocess.check_call(["scontrol", "requeue", job_id], timeout=60)`
    (submitit/slurm/slurm.py, `_requeue`; its timeout came with facebookincubator/submitit#1713).
    Slurm carries the requeue out by sending SIGTERM to every process of the job's steps, and
    scontrol runs in rank 0's step: when the SIGTERM reaches scontrol before it has exited,
    check_call raises, that error becomes rank 0's result, and the flow reports a failed job
    that Slurm has requeued. submitit has no hook for the requeue command, so the method is
    replaced in the rank's process (cluster.rank_main). No upstream issue covers it yet.
    Versions: SUBMITIT_VERSIONS.
    """
    from submitit.core import logger
    from submitit.slurm.slurm import SlurmJobEnvironment

    def _requeue(self: SlurmJobEnvironment, countdown: int) -> None:
        requeue(self.job_id)
        logger.get_logger().info(f"Requeued job {self.job_id} (scontrol shielded from SIGTERM)")

    SlurmJobEnvironment._requeue = _requeue  # type: ignore[method-assign]


def import_slurm_cluster() -> Any:
    """dask_jobqueue's SLURMCluster, imported without the SIGINT handler its import installs.

    Why: dask_jobqueue.runner runs `signal.signal(signal.SIGINT, lambda *_: sys.exit())` when
    imported (dask/dask-jobqueue#696, fixed by #697 after 0.9.0): Ctrl-C would then end the
    flow with exit status 0 instead of KeyboardInterrupt, and the import raises off the main
    thread, where signal.signal is refused. `signal.signal` is held off for the import alone.
    Versions: DASK_JOBQUEUE_VERSIONS.
    """
    if "dask_jobqueue" in sys.modules:
        return sys.modules["dask_jobqueue"].SLURMCluster
    real = signal.signal
    signal.signal = lambda signum, _handler: signal.getsignal(signum)  # type: ignore[assignment]
    try:
        from dask_jobqueue import SLURMCluster
    finally:
        signal.signal = real
    return SLURMCluster


def fake_forward(model: Any, *args: Any) -> Any:
    """`model(*args)` for a model built on the meta device, run under torch's FakeTensorMode
    (`torch._subclasses.fake_tensor`): shapes and dtypes propagate, nothing is allocated.

    Why: transformers models look at their inputs' values in the forward pass (masking_utils'
    `find_packed_sequence_indices` calls `.all()` on the position ids; huggingface/transformers
    #43957 is the same kind of failure at load time), which meta tensors refuse ("Tensor.item()
    cannot be called on meta tensors"). transformers skips those checks for fake tensors
    (`is_tracing`), the mode torch.export traces in; torch exposes FakeTensorMode only under
    its private `torch._subclasses`. Versions: TORCH_FAKE_VERSIONS, TRANSFORMERS_FAKE_VERSIONS.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return model(*args)


@contextmanager
def mlflow_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking URI set to `uri` for the block, then set back to what it
    was, "nothing set" included (MLflow's own `_use_tracking_uri`).

    Why: MLflow's public API can read the URI in effect (`get_tracking_uri`, which falls back to
    MLFLOW_TRACKING_URI and then a default) and set one, but not tell which one this process set
    nor go back to none: `set_tracking_uri` is typed and documented for a string only (an empty
    string is a URI: mlflow/mlflow#14267). No upstream issue asks for a public way back; none
    found. Versions: MLFLOW_VERSIONS.
    """
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(uri):
        yield


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN (mkldnn) computes bf16 on this CPU at all, natively or emulated.

    Why: torch answers this only through the private op `torch.ops.mkldnn.
    _is_mkldnn_bf16_supported` (torch's own tests call it, e.g. pytorch/pytorch#136290);
    `torch.backends.cpu.get_cpu_capability()` names the vector ISA torch dispatches to, which
    an environment variable can lower and which says nothing of Arm's bf16. No upstream issue
    asks for a public check; none found (pytorch/pytorch#60459 is about the same check's
    platforms). False when the op is missing or fails. Versions: TORCH_MKLDNN_VERSIONS.
    """
    import torch

    try:
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):
        return False


def start_requested_workers(cluster: Any) -> None:
    """Have a dask SpecCluster (dask-jobqueue's SLURMCluster) start the workers its
    `worker_spec` asks for now, raising what starting one raised.

    Why: the public `scale(n)` only schedules `_correct_state` on the cluster's event loop, where
    a failing `sbatch` is logged as "Task exception was never retrieved" and the worker never
    comes (dask/dask-jobqueue#619, open). SpecCluster's docstring names `_correct_state` as the
    way to align workers with `worker_spec`; it is awaited here on the cluster's loop.
    Versions: DISTRIBUTED_VERSIONS.
    """
    cluster.sync(cluster._correct_state)


class SubmititCommandHooks:
    """What a submitit executor runs for each task, and around submitting, through two public
    methods a trainflow executor defines: `task_command()` and `submitting(submit)`.

    Why: submitit has no public option for either; its executors build both from the protected
    `_submitit_command_str` (the command each task runs: `python -u -m submitit.core._submit
    <folder>`) and `_internal_process_submissions` (pickles the calls, submits the jobs), which
    its own Slurm and local executors override too. This mixin is the only place trainflow
    overrides them (first in the bases, before the submitit executor). The other methods an
    executor implements (`_submit_command`, `_num_tasks`, `_make_submission_file_text`, ...)
    are the abstract interface of `submitit.core.core.PicklingExecutor`, which submitit's
    executor plug-ins (submitit.core.plugins) implement. No upstream issue found.
    Versions: SUBMITIT_VERSIONS.
    """

    def task_command(self) -> str:
        """The shell command each of a job's tasks runs."""
        raise NotImplementedError

    def submitting(self, submit: Callable[[], list[Any]]) -> list[Any]:
        """Submit through `submit()` (which returns the jobs), with whatever must surround it."""
        return submit()

    @property
    def _submitit_command_str(self) -> str:
        return self.task_command()

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        base = super()._internal_process_submissions  # type: ignore[misc]
        return self.submitting(lambda: base(delayed_submissions))


LIGHTNING_MODULES = ("pytorch_lightning", "lightning")
"""The Lightning packages `import_mlflow_pytorch` keeps out of mlflow.pytorch's import."""


def import_mlflow_pytorch() -> Any:
    """mlflow.pytorch, imported without the Lightning autologging module its import loads.

    Why: mlflow/pytorch/__init__.py ends with `from mlflow.pytorch._lightning_autolog import
    MlflowModelCheckpointCallback` inside `try/except ImportError`, and that module imports
    `pytorch_lightning` at its top. Where Lightning is installed (trainflow's dev extra has it
    for bench/p7_lightning.py), importing mlflow.pytorch imports Lightning, torchmetrics and
    through them transformers: ~2.5 s of the evaluate stage on 2 cores, and ~3,000 more modules
    that the process's exit tears down. trainflow logs and loads models with mlflow.pytorch and
    never uses Lightning's callback. The import runs with `sys.modules` holding None for the
    Lightning packages (Python's documented way to make an import raise ImportError), so
    MLflow's own `except ImportError` skips the callback; the entries are removed after, so
    Lightning (and MLflow's Lightning autologging, which imports it again when called) import
    normally later in the process. Where mlflow.pytorch or Lightning is already imported, a
    plain import. No upstream issue asks for the callback's import to be deferred; none found
    (Lightning-AI/pytorch-lightning#12786 is Lightning's own import time).
    Versions: MLFLOW_PYTORCH_VERSIONS.
    """
    import importlib

    if "mlflow.pytorch" in sys.modules or any(m in sys.modules for m in LIGHTNING_MODULES):
        return importlib.import_module("mlflow.pytorch")
    blocked = [m for m in LIGHTNING_MODULES if m not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        return importlib.import_module("mlflow.pytorch")
    finally:
        for name in blocked:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]
