"""The one place trainflow replaces part of a library's private internals.

Each entry says what it replaces, why no public API does the job, the upstream code it tracks,
and the versions it was checked against; tests/unit/test_compat.py fails when an installed
version differs or the replaced code no longer looks as the entry expects.
"""

import signal
import sys
from collections.abc import Callable
from typing import Any

SUBMITIT_VERSIONS = ("1.5.4",)
"""submitit versions whose `SlurmJobEnvironment._requeue` `shield_submitit_requeue` replaces."""
DASK_JOBQUEUE_VERSIONS = ("0.9.0",)
"""dask-jobqueue versions whose import `import_slurm_cluster` shields."""
TORCH_FAKE_VERSIONS = ("2.13.0",)
"""torch versions (without the local +cpu/+cu tag) whose FakeTensorMode `fake_forward` uses."""
TRANSFORMERS_FAKE_VERSIONS = ("5.24.0",)
"""transformers versions whose meta-device forward `fake_forward` was checked against."""


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
