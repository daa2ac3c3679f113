"""trainflow.compat's uses of MLflow's, torch's, distributed's and submitit's internals: each
test fails when the installed version differs or the internals no longer do what the entry
says (the other entries: tests/unit/test_compat.py)."""

import importlib.metadata
import inspect
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import submitit
from submitit.core.core import PicklingExecutor

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.compat import (
    DISTRIBUTED_VERSIONS,
    MLFLOW_VERSIONS,
    SUBMITIT_VERSIONS,
    TORCH_MKLDNN_VERSIONS,
)


def _run(code: str) -> str:
    """`code` in a fresh interpreter without MLFLOW_TRACKING_URI; its stdout."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_mlflow_is_a_version_the_tracking_uri_entry_was_checked_against() -> None:
    import mlflow

    assert mlflow.__version__ in MLFLOW_VERSIONS, (
        f"mlflow {mlflow.__version__}: re-check trainflow.compat.mlflow_tracking_uri against "
        "mlflow.tracking._tracking_service.utils._use_tracking_uri, then add the version"
    )


def test_the_tracking_uri_goes_back_to_none_or_to_what_was_set() -> None:
    code = (
        "import mlflow, os; from mlflow.tracking import is_tracking_uri_set; "
        "from trainflow.compat import mlflow_tracking_uri as use\n"
        "with use('sqlite:///a.db'):\n"
        "    inside = mlflow.get_tracking_uri()\n"
        "print(inside, is_tracking_uri_set(), 'MLFLOW_TRACKING_URI' in os.environ)\n"
        "mlflow.set_tracking_uri('http://before:5000')\n"
        "with use('sqlite:///b.db'):\n"
        "    pass\n"
        "print(mlflow.get_tracking_uri())"
    )
    assert _run(code).splitlines() == ["sqlite:///a.db False False", "http://before:5000"]


def test_torch_is_a_version_whose_mkldnn_bf16_op_was_checked() -> None:
    import torch

    from trainflow.compat import mkldnn_bf16_supported

    assert torch.__version__.split("+")[0] in TORCH_MKLDNN_VERSIONS, (
        f"torch {torch.__version__}: re-check trainflow.compat.mkldnn_bf16_supported "
        "(torch.ops.mkldnn._is_mkldnn_bf16_supported, or a public check), then add the version"
    )
    # Called directly, a renamed or removed op raises here instead of reading as "no bf16".
    answer = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert mkldnn_bf16_supported() is (answer and torch.backends.mkldnn.is_available())


def test_distributed_is_a_version_whose_spec_cluster_scales_through_correct_state() -> None:
    from distributed.deploy.spec import SpecCluster

    version = importlib.metadata.version("distributed")
    assert version in DISTRIBUTED_VERSIONS, (
        f"distributed {version}: re-check trainflow.compat.start_requested_workers, then add it"
    )
    assert list(inspect.signature(SpecCluster._correct_state).parameters) == ["self"]
    assert "_correct_state" in inspect.getsource(SpecCluster.scale)


@pytest.mark.services
def test_the_workers_a_spec_asks_for_are_started_before_it_returns() -> None:
    from distributed import LocalCluster

    from trainflow.compat import start_requested_workers

    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        while len(cluster.worker_spec) < 2:
            cluster.worker_spec.update(cluster.new_worker_spec())
        start_requested_workers(cluster)
        assert len(cluster.workers) == 2  # started, not only scheduled on the loop


def test_submitits_executor_hooks_keep_their_names_and_signatures() -> None:
    assert submitit.__version__ in SUBMITIT_VERSIONS, (
        f"submitit {submitit.__version__}: re-check trainflow.compat.SubmititCommandHooks"
    )
    for executor in (PicklingExecutor, submitit.SlurmExecutor, submitit.LocalExecutor):
        assert isinstance(inspect.getattr_static(executor, "_submitit_command_str"), property)
        method = executor._internal_process_submissions
        assert list(inspect.signature(method).parameters) == ["self", "delayed_submissions"]
    # What cluster.srun_executor's AllocationExecutor implements: PicklingExecutor's interface.
    interface = {"_make_submission_file_text", "_make_submission_command", "_num_tasks"}
    interface |= {"_get_job_id_from_submission_command"}
    assert interface <= PicklingExecutor.__abstractmethods__
    for name in ("_submit_command", "_valid_parameters", "_internal_update_parameters"):
        assert callable(getattr(PicklingExecutor, name))


def test_the_sbatch_script_runs_trainflows_guarded_rank_command(tmp_path: Path) -> None:
    executor = make_executor(ClusterConfig(executor="slurm", ranks_per_node=2), tmp_path)
    text = executor._make_submission_file_text(  # type: ignore[attr-defined]
        executor._submitit_command_str,  # type: ignore[attr-defined]
        "uid",
    )
    srun = [line for line in text.splitlines() if line.startswith("srun")]
    assert len(srun) == 1 and "-m trainflow.cluster.rank_guard" in srun[0]
    assert srun[0].endswith(f"-m trainflow.cluster.rank_main {tmp_path}")
    assert "submitit.core._submit" not in text


def _main_module() -> str:
    return str(sys.modules["__main__"].__spec__.name)  # type: ignore[union-attr]


@pytest.mark.services
def test_a_local_job_runs_through_trainflows_entry_and_is_submitted_privately(
    tmp_path: Path,
) -> None:
    executor = make_executor(ClusterConfig(executor="local", ranks_per_node=1), tmp_path)
    job = executor.submit(_main_module)
    mode = stat.S_IMODE(job.paths.submitted_pickle.stat().st_mode)
    assert job.result() == "trainflow.cluster.rank_main"
    assert mode & 0o077 == 0, oct(mode)
