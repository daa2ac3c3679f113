"""Training never waits on the MLflow tracking server: real servers stopped and started again.

Each test runs a real `mlflow server` (SQLite store) and stops it for real; training runs as a
real job (one rank, local executor) whose journal a Relay in this process sends on, as the
train task's does. Gates (files the test creates) hold the job at chosen epochs, so what
happens while the server is down does not depend on timing.
"""

import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import submitit
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tests.gates import GatedJob
from tests.services import free_port, mlflow_server, wait_for
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.flows.service_errors import explain_refusal
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.tracking.journal import Journal
from trainflow.tasks.tracking.logger import make_logger
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
from trainflow.tasks.tracking.relay import Relay, TrackingUnavailable
from trainflow.tasks.tracking.sender import MetricSender
from trainflow.tasks.train.checkpointing.checkpoint import latest_checkpoint
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

cloudpickle.register_pickle_by_value(sys.modules[__name__])

_KEYS = ("train_loss", "val_accuracy", "lr", "epoch_time_s")
_DOWN = "unreachable ("  # the sender's warning line
_BACK = "reachable again"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One local store for the tests that need no server (creating one takes ~10 s)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"


def _run_id(url: str, folder: Path) -> str:
    return PipelineRuns(TrackingConfig(tracking_uri=url, experiment="t"), folder, "p").parent_id


def _steps(url: str, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(url).get_metric_history(run_id, key))


def _submit(
    dataset: DatasetRef, tmp: Path, url: str, run_id: str, epochs: int, gates: dict[int, Path]
) -> tuple[TrainJobSpec, submitit.Job[Any]]:
    spec = TrainJobSpec(
        train=TrainConfig(epochs=epochs, batch_size=32, device="cpu", precision="fp32"),
        dataset=dataset,
        out_dir=tmp / "run",
        tracking_uri=url,
        run_id=run_id,
    )
    executor = make_executor(ClusterConfig(ranks_per_node=1, timeout_min=10), tmp / "jobs")
    return spec, executor.submit(GatedJob(spec, gates))


def _epoch_done(spec: TrainJobSpec, epoch: int) -> bool:
    path = latest_checkpoint(spec.out_dir / "checkpoints")
    return path is not None and int("".join(filter(str.isdigit, path.name)) or 0) >= epoch


@pytest.mark.services
def test_a_server_stopped_mid_training_and_started_again_gets_every_point_once(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    store, port = tmp_path / "mlflow", free_port()
    gates = {3: tmp_path / "gate-3", 7: tmp_path / "gate-7"}
    lines: list[str] = []
    with mlflow_server(store, port=port) as url:
        run_id = _run_id(url, tmp_path)
        spec, job = _submit(dataset, tmp_path, url, run_id, 8, gates)
        relay = Relay(spec.out_dir, url, run_id, say=lines.append)
        relay.start()
        wait_for(lambda: _steps(url, run_id, "lr") == [1, 2], 180, "epochs 1-2 logged")
    # The server is gone (stopped like a crashed one: its port refuses connections).
    gates[3].touch()
    wait_for(lambda: _epoch_done(spec, 6), 180, "epochs 3-6 trained while the server is down")
    wait_for(lambda: any(_DOWN in line for line in lines), 60, "the relay to say it")
    with mlflow_server(store, port=port) as url2:
        assert url2 == url
        gates[7].touch()
        ref = wait_for_job(job, lines.append, poll_s=0.2)
        assert isinstance(ref, CheckpointRef)
        relay.finish()  # what the relay could not send yet, now (train_task)
        for key in _KEYS:
            assert _steps(url, run_id, key) == list(range(1, 9)), key
        history = MlflowClient(url).get_metric_history(run_id, "train_loss")
        assert [m.step for m in sorted(history, key=lambda m: m.timestamp)] == list(range(1, 9))
    assert sum(_DOWN in line for line in lines) == 1, lines
    assert sum(_BACK in line for line in lines) <= 1, lines


@pytest.mark.services
def test_a_server_that_never_comes_back_lets_training_finish_and_ends_with_a_clear_error(
    dataset: DatasetRef, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gates = {2: tmp_path / "gate-2"}
    lines: list[str] = []
    with mlflow_server(tmp_path / "mlflow") as url:
        runs = PipelineRuns(TrackingConfig(tracking_uri=url, experiment="t"), tmp_path, "p")
        train_run = runs.open_stage("train", {})
        spec, job = _submit(dataset, tmp_path, url, train_run, 5, gates)
        relay = Relay(spec.out_dir, url, train_run, say=lines.append)
        relay.start()
        wait_for(lambda: _steps(url, train_run, "lr") == [1], 180, "epoch 1 logged")
    gates[2].touch()
    ref = wait_for_job(job, lambda line: None, poll_s=0.2)

    # Training and its checkpoints are complete; every epoch's points are in the journal.
    assert isinstance(ref, CheckpointRef) and ref.path.is_file()
    assert _epoch_done(spec, 5)
    journal = (spec.out_dir / "tracking" / "rank0.jsonl").read_text()
    assert all('"lr",' in journal and f",{step}]" in journal for step in range(1, 6))

    # The flow's end of the job: a clear error, in bounded time, naming where the points are.
    start = time.monotonic()
    with pytest.raises(TrackingUnavailable, match=r"\d+ metric points of training run") as gone:
        relay.finish()
    assert str(spec.out_dir / "tracking") in str(gone.value)
    assert sum(_DOWN in line for line in lines) == 1, lines
    # Marking the runs FAILED on the dead server is skipped at once, with a warning.
    runs.close(train_run, RuntimeError("boom"))
    runs.close(runs.parent_id, RuntimeError("boom"))
    # Any other call of the flow fails after ~10 s of retries (not minutes), and reads as a line.
    with pytest.raises(MlflowException) as err:
        runs.tag(runs.parent_id, {"k": "v"})
    assert f"{url} cannot be reached (connection refused" in str(explain_refusal(err.value))
    assert time.monotonic() - start < 120  # a guard against MLflow's minutes of retries
    assert capsys.readouterr().err.count("is unreachable") == 2


@pytest.mark.services
def test_points_an_earlier_flow_could_not_send_are_sent_by_the_next_with_the_new_ones(
    tmp_path: Path, sqlite_store: str
) -> None:
    url = sqlite_store
    run_id = _run_id(url, tmp_path)
    Journal(tmp_path, "rank0").metrics([("x", float("nan"), 5, 1)])  # an earlier attempt's
    logger = make_logger(Journal(tmp_path, "rank0"))
    logger.log({"x": 2.0}, step=2)
    assert logger.close() == 0
    Relay(tmp_path, url, run_id, say=print).finish()
    hist = sorted(MlflowClient(url).get_metric_history(run_id, "x"), key=lambda m: m.step)
    assert [m.step for m in hist] == [1, 2]
    assert hist[0].value != hist[0].value  # NaN survives the round trip


def test_a_full_buffer_drops_and_counts_newer_points_instead_of_blocking(
    tmp_path: Path, sqlite_store: str
) -> None:
    from mlflow.entities import Metric

    url = sqlite_store
    lines: list[str] = []
    sender = MetricSender(url, _run_id(url, tmp_path), say=lines.append, max_points=3)
    sender.put([Metric("x", float(s), 1, s) for s in range(1, 6)])  # not woken: nothing sent
    assert sender.dropped == 2 and len(lines) == 1 and "buffer full" in lines[0]
    assert [m.step for m in sender.close(drain_s=60)] == []  # close sends the 3 it kept
    assert sender.sent == 3
