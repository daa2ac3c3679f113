"""Warm ranks (cluster.warm_ranks): local ranks forked from one server that has torch, dynamo
and MLflow imported, reused across jobs; every guarantee of a fresh rank kept.

Real local jobs through submitit's local executor and cluster.rank_guard, nothing mocked.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pytest
import submitit
import torch

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.cluster.warm_pool import pool_pid, stop_pool
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(180)


def _local(folder: Path, warm: bool = True, ranks: int = 2) -> submitit.Executor:
    cfg = ClusterConfig(ranks_per_node=ranks, timeout_min=5, warm_ranks=warm)
    return make_executor(cfg, folder)


def _where_am_i() -> dict[str, object]:
    """What a rank saw at its start: its parent and whether torch was loaded before it ran."""
    return {"ppid": os.getppid(), "pid": os.getpid(), "dynamo": "torch._dynamo" in sys.modules,
            "cwd": os.getcwd(), "rank": os.environ.get("SUBMITIT_LOCAL_GLOBALID")}  # fmt: skip


def _records(job: submitit.Job[object], tasks: int) -> list[dict[str, object]]:
    """Each rank's start record (cluster.rank_guard), waiting for them to be written."""
    paths = [job.paths.folder / f"{job.job_id}_{t}_rank.json" for t in range(tasks)]
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, "a rank never started"
        time.sleep(0.1)
    return [json.loads(p.read_text()) for p in paths]


def test_ranks_of_two_jobs_are_forked_from_one_warm_server(tmp_path: Path) -> None:
    seen = []
    for i in range(2):
        job = _local(tmp_path / f"jobs-{i}").submit(_where_am_i)
        results = job.results()
        seen += results
        assert all(r["warm"] for r in _records(job, 2))
        assert [r["pid"] for r in results] == [r["pid"] for r in _records(job, 2)]
    server = pool_pid()
    assert server is not None
    assert {r["ppid"] for r in seen} == {server}  # both jobs: the same server
    assert all(r["dynamo"] for r in seen)  # imported before the rank's own code ran
    assert {r["cwd"] for r in seen} == {os.getcwd()}
    assert len({r["pid"] for r in seen}) == 4  # a fresh fork per rank and job


def test_a_cold_rank_is_a_fresh_process_of_its_guard(tmp_path: Path) -> None:
    job = _local(tmp_path / "jobs", warm=False, ranks=1).submit(_where_am_i)
    (result,) = job.results()
    assert result["dynamo"] is False and result["ppid"] != pool_pid()
    assert _records(job, 1)[0]["warm"] is False


def _sleep_forever() -> None:
    print("started", flush=True)
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_cancelling_the_watcher_leaves_no_warm_rank(tmp_path: Path) -> None:
    job = _local(tmp_path / "jobs").submit(_sleep_forever)
    pids: list[int] = []

    def interrupt_at_first_output(line: str) -> None:
        pids.extend(int(str(r["pid"])) for r in _records(job, 2))
        pids.extend(int(str(r["guard_pid"])) for r in _records(job, 2))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_for_job(job, interrupt_at_first_output, poll_s=0.1)
    assert len(pids) == 4 and _gone_within(pids, 15)
    assert pool_pid() is not None  # the server stays for the next job


def test_a_guard_killed_outright_takes_its_warm_rank_with_it(tmp_path: Path) -> None:
    job = _local(tmp_path / "jobs", ranks=1).submit(_sleep_forever)
    (record,) = _records(job, 1)
    os.kill(int(str(record["guard_pid"])), signal.SIGKILL)  # as the controller does after cancel
    assert _gone_within([int(str(record["pid"]))], 15)
    job.cancel()


def _export_imported() -> bool:
    """Whether the server this rank was forked from had imported the model export's modules."""
    return "torch.export._trace" in sys.modules


def _fail() -> None:
    raise RuntimeError("this rank fails")


def test_the_export_imports_follow_only_a_job_that_trained(tmp_path: Path) -> None:
    """The server imports the evaluate stage's export modules (warm_ranks.LATER) after a job
    whose ranks succeeded, not after one whose ranks failed or were killed: no evaluate stage
    follows those, and a cancelled run's server must not stay seconds longer to import them."""
    stop_pool()  # a new server: this process's earlier jobs may have had it import them
    failed = _local(tmp_path / "failed", ranks=1).submit(_fail)
    with pytest.raises(submitit.core.utils.FailedJobError):
        failed.results()
    killed = _local(tmp_path / "killed", ranks=1).submit(_sleep_forever)
    (record,) = _records(killed, 1)
    os.kill(int(str(record["guard_pid"])), signal.SIGKILL)  # as the controller does after cancel
    assert _gone_within([int(str(record["pid"]))], 15)
    killed.cancel()
    first = _local(tmp_path / "first", ranks=1).submit(_export_imported)
    assert first.results() == [False]  # neither job made the server import them
    second = _local(tmp_path / "second", ranks=1).submit(_export_imported)
    assert second.results() == [True]  # the first job succeeded: imported before this fork


def test_a_warm_rank_trains_exactly_as_a_cold_one(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "ds")
    states = []
    for warm in (True, False):
        cfg = TrainConfig(epochs=2, batch_size=32, device="cpu", precision="fp32", seed=7)
        spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / f"run-{warm}")
        job = _local(tmp_path / f"jobs-{warm}", warm=warm).submit(TrainingJob(spec))
        ref = wait_for_job(job, lambda line: None, poll_s=0.2)
        assert isinstance(ref, CheckpointRef)
        assert _records(job, 2)[0]["warm"] is warm
        states.append(torch.load(ref.path, weights_only=True)["model"])
    warm_state, cold_state = states
    assert warm_state.keys() == cold_state.keys()
    assert all(torch.equal(warm_state[k], cold_state[k]) for k in warm_state)


def test_the_model_export_runs_in_a_warm_fork_and_logs_the_same_model(tmp_path: Path) -> None:
    import mlflow.pytorch
    from mlflow.tracking import MlflowClient

    from trainflow.tasks.evaluate.run import load_model
    from trainflow.tasks.evaluate.warm_export import log_model_warm
    from trainflow.tasks.tracking.runs import use_tracking_uri

    dataset = write_dataset(tmp_path / "ds")
    cfg = TrainConfig(epochs=1, batch_size=32, device="cpu", precision="fp32")
    spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run")
    ref = wait_for_job(_local(tmp_path / "jobs").submit(TrainingJob(spec)), lambda _: None)
    assert isinstance(ref, CheckpointRef)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    x = torch.randn(4, 1, 12, 12)
    model_uri = log_model_warm(ref, cfg, dataset, x.numpy(), uri, run_id)
    assert model_uri is not None
    with use_tracking_uri(uri), torch.no_grad():
        loaded = mlflow.pytorch.load_model(model_uri)
        torch.testing.assert_close(loaded(x), load_model(ref, cfg, dataset)(x))


def test_what_the_warm_export_raised_reaches_the_flow(tmp_path: Path) -> None:
    from trainflow.cluster.warm_pool import warm_pool
    from trainflow.tasks.evaluate.warm_export import ExportFailed, log_model_warm

    assert warm_pool() is not None
    weights = tmp_path / "best.pt"
    weights.write_bytes(b"not these weights")
    ckpt = CheckpointRef(path=weights, sha256="-", epoch=1, step=1, metrics={},
                         history_path=tmp_path / "history.json")  # fmt: skip
    dataset = write_dataset(tmp_path / "ds")
    with pytest.raises(ExportFailed, match=r"DataError: checkpoint .* does not match its record"):
        log_model_warm(ckpt, TrainConfig(), dataset, np.zeros((1, 1, 12, 12), np.float32),
                       f"sqlite:///{tmp_path}/m.db", "run")  # fmt: skip
    stop_pool()  # without a server of this process the caller exports itself (None)
    assert log_model_warm(ckpt, TrainConfig(), dataset, np.zeros((1, 1, 12, 12), np.float32),
                          f"sqlite:///{tmp_path}/m.db", "run") is None  # fmt: skip


_EDITED_MODELS = """\
from torch import nn


def build(spec):
    c, h, w = spec.sample_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, spec.num_classes))
"""


def test_the_warm_export_builds_the_submitted_model_not_the_edited_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user edits their model file while the run trains: the forked export (which runs
    in the flow's working folder) must build the model from the run's code snapshot."""
    import mlflow.pytorch
    from mlflow.tracking import MlflowClient

    from trainflow.cluster.snapshot import code_path, snapshot_for_jobs
    from trainflow.tasks.evaluate.run import load_model
    from trainflow.tasks.evaluate.warm_export import log_model_warm
    from trainflow.tasks.tracking.runs import use_tracking_uri

    project = tmp_path / "proj"
    project.mkdir()
    (project / "edited_models.py").write_text(_EDITED_MODELS)
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.chdir(project)  # the live file is in the working folder of every fork too
    code = snapshot_for_jobs(["edited_models"], tmp_path / "run" / "jobs")
    assert code is not None
    dataset = write_dataset(tmp_path / "ds")
    cfg = TrainConfig(model="edited_models:build", epochs=1, batch_size=32, device="cpu",
                      precision="fp32")  # fmt: skip
    spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run", code=code.paths)
    ref = wait_for_job(_local(tmp_path / "jobs").submit(TrainingJob(spec)), lambda _: None)
    assert isinstance(ref, CheckpointRef)
    (project / "edited_models.py").write_text(
        "def build(spec):\n    raise RuntimeError('edited after submission')\n"
    )
    sys.modules.pop("edited_models", None)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    x = torch.randn(4, 1, 12, 12)
    model_uri = log_model_warm(ref, cfg, dataset, x.numpy(), uri, run_id, code.paths)
    assert model_uri is not None
    try:
        with code_path(code.paths), use_tracking_uri(uri), torch.no_grad():
            expected = load_model(ref, cfg, dataset)(x)
            torch.testing.assert_close(mlflow.pytorch.load_model(model_uri)(x), expected)
    finally:
        sys.modules.pop("edited_models", None)
