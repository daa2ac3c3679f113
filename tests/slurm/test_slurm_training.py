"""Training through the real Slurm cluster: request checks, DDP, failures, accounting, polling.

Nothing is mocked: jobs go through sbatch/srun on the dev cluster (tests/slurm/conftest.py),
are watched with cluster.jobs.wait_for_job as the flow does, and their cost is read from sacct.
"""

import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import cloudpickle
import pytest
from mlflow.tracking import MlflowClient

from tests.unit.datasets import write_dataset
from tests.unit.test_train_job import FailingRank1  # shipped by value, like this module
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import NODE_CHECK_S, wait_for_job
from trainflow.cluster.slurm_checks import (
    Partition,
    check_against,
    check_request,
    read_nodes,
    read_partitions,
)
from trainflow.errors import ConfigError, JobError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.tracking.job_accounting import record_job_accounting
from trainflow.tasks.tracking.relay import relaying
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import _export_submitit_env
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

pytestmark = pytest.mark.timeout(180)
# The job processes cannot import this test module: ship its classes and functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


Run = tuple[MlflowClient, str]


def _slurm(**fields: object) -> ClusterConfig:
    return ClusterConfig.model_validate({"executor": "slurm", "timeout_min": 10, **fields})


def _node() -> dict[str, int]:
    """CPUs, memory (MiB) and GPUs of the dev cluster's first node (all are alike), from
    `scontrol` itself."""
    out = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True)
    rec = dict(re.findall(r"(\w+)=(\S*)", out.stdout.splitlines()[0]))
    gpus = int((re.findall(r"gres/gpu=(\d+)", rec["CfgTRES"]) or ["0"])[0])
    return {"cpus": int(rec["CPUTot"]), "mem_mb": int(rec["RealMemory"]), "gpus": gpus}


def _default_partition() -> Partition:
    return next(p for p in read_partitions() if p.default)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


@pytest.fixture
def tracked_run(tmp_path: Path) -> Run:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("slurm", artifact_location=(tmp_path / "art").as_uri())
    return client, str(client.create_run(exp).info.run_id)


def _spec(dataset: DatasetRef, out: Path, run: Run, epochs: int) -> TrainJobSpec:
    train = TrainConfig(epochs=epochs, batch_size=32, device="cpu", precision="fp32")
    uri, run_id = run[0].tracking_uri, run[1]
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out, tracking_uri=uri, run_id=run_id)


# --- (a) requests the cluster cannot run are refused before anything is queued -------------


def test_a_request_the_cluster_can_run_passes() -> None:
    check_request(_slurm(ranks_per_node=2, gpus_per_node=2, mem_gb=_node()["mem_mb"] / 2048))


def test_an_unknown_partition_is_refused_with_the_partitions_there_are() -> None:
    with pytest.raises(ConfigError) as err:
        check_request(_slurm(partition="nope"))
    assert "cluster.partition='nope'" in str(err.value)
    assert f"set cluster.partition to one of: {_default_partition().name}" in str(err.value)


def _too_big(resource: str, node: dict[str, int]) -> tuple[dict[str, object], list[str]]:
    """A request exceeding the node in one resource, and what its refusal must say."""
    cpus, mem_gb, gpus = node["cpus"] // 2 + 1, node["mem_mb"] / 1024 + 1, node["gpus"] + 2
    cases: dict[str, tuple[dict[str, object], list[str]]] = {
        "cpus": (
            {"cpus_per_task": cpus},
            [f"cpus_per_task={cpus}", f"offers {node['cpus']}:", "lower cluster.cpus_per_task"],
        ),
        "mem": (
            {"mem_gb": mem_gb},
            [f"cluster.mem_gb={mem_gb}", f"offers {node['mem_mb']} MiB", "set cluster.mem_gb<="],
        ),
        "gpus": (
            {"ranks_per_node": gpus, "gpus_per_node": gpus},
            [f"cluster.gpus_per_node={gpus}", f"has {node['gpus']} GPU(s)", "0 for CPU training"],
        ),
    }
    return cases[resource]


@pytest.mark.parametrize("resource", ["cpus", "mem", "gpus"])
def test_more_than_a_node_has_is_refused_naming_field_offer_and_fix(resource: str) -> None:
    fields, expected = _too_big(resource, _node())
    with pytest.raises(ConfigError) as err:
        check_request(_slurm(**{"ranks_per_node": 2, **fields}))
    for text in expected:
        assert text in str(err.value)
    assert "cluster.partition" in str(err.value)  # the other way out


def test_more_nodes_than_the_partition_has_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.nodes=3, .* at most 2 node\(s\): set"):
        check_request(_slurm(nodes=3, ranks_per_node=1))


def test_a_time_limit_above_the_partitions_max_time_is_refused() -> None:
    # The dev cluster's `short` partition has MaxTime=30 (minutes).
    check_request(_slurm(partition="short", timeout_min=30))
    with pytest.raises(
        ConfigError, match=r"cluster\.timeout_min=31.*MaxTime.*set cluster\.timeout"
    ):
        check_request(_slurm(partition="short", timeout_min=31))


def test_the_time_check_applies_a_partitions_max_time() -> None:
    # The dev partition is unlimited: its real record, with a MaxTime as a site would set it.
    parts, nodes = [dataclasses.replace(_default_partition(), max_time_min=30)], read_nodes()
    check_against(_slurm(timeout_min=30), parts, nodes)
    with pytest.raises(ConfigError, match=r"timeout_min=31, .* MaxTime 30 min: set cluster\."):
        check_against(_slurm(timeout_min=31), parts, nodes)


def test_without_slurm_tools_the_error_says_how_to_get_a_cluster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"not on PATH.*trainflow cluster up.*executor=local"):
        check_request(_slurm())
    monkeypatch.undo()
    (tmp_path / "broken.conf").write_text("")  # a missing file makes scontrol hang instead
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "broken.conf"))
    with pytest.raises(ConfigError, match=r"not reachable \(`scontrol show part.*executor=local"):
        check_request(_slurm())
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    with pytest.raises(ConfigError, match=r"SLURM_CONF=.*missing\.conf does not exist.*sh env"):
        check_request(_slurm())
    monkeypatch.delenv("SLURM_CONF")
    with pytest.raises(ConfigError, match=r"SLURM_CONF is not set.*slurm\.sh env"):
        check_request(_slurm())


def test_sbatch_options_trainflow_sets_cannot_be_overridden() -> None:
    with pytest.raises(ValueError, match=r"'time' is set by trainflow.*cluster\.timeout_min"):
        _slurm(sbatch_extra={"time": "10"})
    with pytest.raises(ValueError, match=r"'cpus-per-task' .* cluster\.cpus_per_task"):
        _slurm(sbatch_extra={"cpus-per-task": "4"})
    with pytest.raises(ValueError, match=r"only Slurm spans several nodes"):
        ClusterConfig(nodes=2)


def test_the_sbatch_script_carries_every_field(submitit_folder: Path) -> None:
    cfg = _slurm(
        partition="debug",
        qos="normal",
        account="ml",
        mem_gb=1.5,
        signal_delay_s=45,
        sbatch_extra={"constraint": "a100", "job-name": "mine"},
    )
    executor = make_executor(cfg, submitit_folder)
    text = executor._make_submission_file_text("true", "uid")  # type: ignore[attr-defined]
    expected = "--partition=debug --qos=normal --account=ml --mem=1536M --signal=USR2@45 --time=10"
    expected += " --ntasks-per-node=2 --cpus-per-task=1 --nodes=1 --constraint=a100 --job-name=mine"
    for option in expected.split():
        assert f"#SBATCH {option}\n" in text
    assert "gpus" not in text and "trainflow-train" not in text


# --- (b) two DDP ranks train through Slurm; accounting reaches the MLflow run -------------


def test_two_ranks_train_through_slurm_and_the_run_gets_the_accounting(
    dataset: DatasetRef,
    tmp_path: Path,
    submitit_folder: Path,
    tracked_run: Run,
) -> None:
    client, run_id = tracked_run
    cfg = _slurm(nodes=2, ranks_per_node=1)  # the accounting counts both nodes
    check_request(cfg)
    since = datetime.now().replace(microsecond=0)  # sacct's Submit has whole seconds
    job = make_executor(cfg, submitit_folder).submit(
        TrainingJob(_spec(dataset, tmp_path / "run", tracked_run, epochs=3))
    )
    lines: list[str] = []
    with relaying(tmp_path / "run", client.tracking_uri, run_id, lines.append):  # as the flow
        ref = wait_for_job(job, lines.append)
    acct = record_job_accounting(job.job_id, client.tracking_uri, run_id, lines.append, since)

    assert isinstance(ref, CheckpointRef) and ref.metrics["val_accuracy"] > 0.5
    assert any("on 2 rank(s): device cpu, backend gloo" in line for line in lines)
    history = client.get_metric_history(run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert acct is not None and acct["state"] == "COMPLETED"
    assert float(acct["elapsed_s"]) > 0 and float(acct["cpu_hours"]) > 0
    assert acct["requeues"] == 0 and acct["gpu_hours"] == 0 and acct["nodes"] == 2
    data = client.get_run(run_id).data
    assert data.metrics["slurm_nodes"] == 2 and data.tags["slurm_node_list"] == "tfnode[1-2]"
    assert data.tags["slurm_state"] == "COMPLETED" and data.tags["slurm_job_id"] == job.job_id
    assert data.metrics["slurm_cpu_hours"] == pytest.approx(
        2 * data.metrics["slurm_elapsed_s"] / 3600
    )


# --- (c) a failing rank fails the job fast, with its traceback ------------------------------


def test_a_failing_rank_fails_the_slurm_job_fast_with_its_traceback(
    dataset: DatasetRef,
    tmp_path: Path,
    submitit_folder: Path,
    tracked_run: Run,
) -> None:
    spec = _spec(dataset, tmp_path / "run", tracked_run, epochs=50)
    since = datetime.now().replace(microsecond=0)
    job = make_executor(_slurm(ranks_per_node=2), submitit_folder).submit(FailingRank1(spec))
    start = time.monotonic()
    with pytest.raises(JobError) as failure:
        wait_for_job(job, lambda line: None)
    assert time.monotonic() - start < 60  # gloo's collective timeout is 5 minutes
    message = str(failure.value)
    assert "failed in rank 1" in message and "ValueError: rank 1 broke on purpose" in message
    assert "in segment" in failure.value.detail  # the remote traceback, beside the error line
    acct = record_job_accounting(job.job_id, None, None, print, since)
    assert acct is not None and acct["state"] == "FAILED"


def test_an_fsdp_job_on_two_nodes_stops_early_and_keeps_its_best_checkpoint(
    dataset: DatasetRef, tmp_path: Path, submitit_folder: Path
) -> None:
    """train.early_stop_patience and keep_checkpoints through Slurm, FSDP over 2 nodes: a run
    that cannot improve by min_delta (lr 1e-9) stops after epoch 3, the job COMPLETED, and
    its folder keeps the best checkpoint by val_loss (read from its history) and the newest."""
    train = TrainConfig(
        epochs=8, batch_size=32, device="cpu", precision="fp32", strategy="fsdp", lr=1e-9,
        monitor="val_loss", early_stop_patience=2, early_stop_min_delta=1e-3,
        keep_checkpoints=1,
    )  # fmt: skip
    spec = TrainJobSpec(train=train, dataset=dataset, out_dir=tmp_path / "run")
    since = datetime.now().replace(microsecond=0)
    job = make_executor(_slurm(nodes=2, ranks_per_node=1), submitit_folder).submit(
        TrainingJob(spec)
    )
    lines: list[str] = []
    ref = wait_for_job(job, lines.append)
    assert isinstance(ref, CheckpointRef)
    history = json.loads(ref.history_path.read_text())
    assert len(history) == 3
    assert sum("early stop at epoch 3: val_loss" in line for line in lines) == 1, lines
    best = min(history, key=lambda h: (h["val_loss"], h["epoch"]))["epoch"]
    assert ref.epoch == best
    kept = {p.name for p in (spec.out_dir / "checkpoints").iterdir()}
    assert kept == {f"epoch-{best:06d}", "epoch-000003"}
    acct = record_job_accounting(job.job_id, None, None, print, since)
    assert acct is not None and acct["state"] == "COMPLETED"


# --- (d) watching a job does not poll sacct every second ------------------------------------


def _tick(seconds: int) -> int:
    for i in range(seconds):
        print(f"tick {i}", flush=True)
        time.sleep(1)
    return seconds


def test_watching_a_job_calls_sacct_a_few_times_not_every_second(
    tmp_path: Path, submitit_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, calls = shutil.which("sacct"), tmp_path / "sacct-calls"
    wrapper = tmp_path / "bin" / "sacct"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    arrivals: list[float] = []
    job = make_executor(_slurm(ranks_per_node=2), submitit_folder).submit(_tick, 20)
    start = time.monotonic()
    assert wait_for_job(job, lambda line: arrivals.append(time.monotonic()), poll_s=1.0) == 20

    polls = calls.read_text().splitlines() if calls.exists() else []
    took = time.monotonic() - start
    print(f"{len(polls)} sacct calls in {took:.1f} s:", *polls, sep="\n  ")
    # submitit's own (at most 7), and trainflow's NODE_FAIL check every NODE_CHECK_S;
    # every second would be > 20 (2 ranks: > 40)
    assert 1 <= len(polls) <= 7 + took // NODE_CHECK_S, polls
    assert all("JobID,State" in p and f"-j {job.job_id}" in p for p in polls)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) >= 40 and max(gaps) < 3  # logs still forwarded within ~1 s


# --- (e) each rank of a GPU job drives its own (fake) GPU -------------------------------------


def _gpu_env() -> tuple[int, str]:
    """The local rank and the GPUs a training rank sees, after trainflow's rank set-up."""
    _export_submitit_env()  # what TrainingJob's distributed() does first
    return int(os.environ["LOCAL_RANK"]), os.environ.get("CUDA_VISIBLE_DEVICES", "")


def test_each_rank_of_a_gpu_job_drives_its_own_gpu(submitit_folder: Path) -> None:
    cfg = _slurm(ranks_per_node=2, gpus_per_node=2)
    check_request(cfg)
    job = make_executor(cfg, submitit_folder).submit(_gpu_env)
    wait_for_job(job, print)
    seen = dict(job.results())
    assert sorted(seen) == [0, 1]
    # --gpus-per-node shows every rank the job's GPUs (NCCL needs its peers visible for CUDA
    # IPC); the rank drives cuda:<local rank> of them (tasks/train/distributed.py).
    assert all(gpus.split(",") == ["0", "1"] for gpus in seen.values()), seen
    driven = {gpus.split(",")[rank] for rank, gpus in seen.items()}
    assert driven == {"0", "1"}
