"""A rank that stops making progress is declared hung by its guard, named with the phase and
the frame it is stuck in, its stacks in its log, and the job restarts from its checkpoint.

Real local jobs (submitit's local executor, each rank under cluster.rank_guard) with
train.hang_timeout_s=3: tests.hanging.HangingJob makes one rank sleep in a loop, spin or block
in a read forever in the forward pass of a chosen step of its first attempt; or the test stops
a rank with SIGSTOP.
"""

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import submitit
import torch

from tests.hanging import HangingJob
from tests.unit.datasets import write_dataset, write_token_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.heartbeat import (
    Beat,
    Heartbeat,
    in_collective,
    position,
    read_beat,
    stuck_frame,
)
from trainflow.cluster.jobs import wait_for_job
from trainflow.cluster.lost_ranks import RankHungError, RankLostError
from trainflow.cluster.restarts import run_with_restarts
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

pytestmark = pytest.mark.timeout(240)
EPOCHS = 5
HANG_S = 3.0


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _spec(dataset: DatasetRef, out: Path, epochs: int = EPOCHS, **train_args: Any) -> TrainJobSpec:
    train = TrainConfig(
        **train_args,
        epochs=epochs,
        batch_size=32,
        device="cpu",
        precision="fp32",
        hang_timeout_s=HANG_S,
        hang_first_step_s=60,
    )
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out)


def _train(
    job: TrainingJob, cfg: ClusterConfig, jobs: Path, log: list[str]
) -> tuple[Any, list[submitit.Job[Any]]]:
    """Run `job` with restarts (cluster.restarts) on the local executor; (result, the jobs)."""
    submitted: list[submitit.Job[Any]] = []

    def submit(exclude: list[str], nodes: int) -> submitit.Job[Any]:
        submitted.append(make_executor(cfg, jobs).submit(job))
        return submitted[-1]

    def wait(job: submitit.Job[Any]) -> Any:
        return wait_for_job(job, lambda line: None, poll_s=0.1)

    return run_with_restarts(cfg, submit, wait, log.append), submitted


def _exit(job: submitit.Job[Any], task: int) -> dict[str, Any]:
    data = json.loads((job.paths.folder / f"{job.job_id}_{task}_exit.json").read_text())
    assert isinstance(data, dict)
    return data


@pytest.mark.services
def test_a_hung_rank_of_two_is_named_with_its_frame_and_the_job_restarts_to_the_same_weights(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    cfg = ClusterConfig(ranks_per_node=2, timeout_min=10, max_restarts=1)
    # The same job with hang detection on and no hang: it finishes, nothing is ended.
    healthy, [plain_job] = _train(
        TrainingJob(_spec(dataset, tmp_path / "plain")), cfg, tmp_path / "j0", []
    )
    assert isinstance(healthy, CheckpointRef)
    assert all(_exit(plain_job, k)["hung"] is None for k in (0, 1))

    # 4 steps an epoch per rank: forward 10 is the second step of epoch 3.
    marker = tmp_path / "hung"
    job = HangingJob(_spec(dataset, tmp_path / "hung-run"), rank=1, at_step=10, marker=marker)
    log: list[str] = []
    started = time.monotonic()
    ref, jobs = _train(job, cfg, tmp_path / "j1", log)
    assert marker.exists() and len(jobs) == 2 and isinstance(ref, CheckpointRef)

    first = jobs[0]
    hung = _exit(first, 1)["hung"]
    assert hung["phase"] == "step" and hung["step"] == 9
    assert HANG_S <= hung["silent_s"] < HANG_S + 5  # the setting, not a collective's timeout
    assert hung["frame"].startswith(f"{Path(__file__).parent.parent}/hanging.py:")
    assert hung["frame"].endswith(" in never_returns")
    assert _exit(first, 0)["hung"] is None  # the peer waiting for it is not blamed
    restart = [line for line in log if "restart 1/1 from the last checkpoint" in line]
    assert len(restart) == 1, log
    rank1_log = first.task(1).paths.stderr
    host = socket.gethostname()
    assert restart[0].startswith(
        f"job {first.job_id} lost rank 1 (node {host}): rank 1 on node {host} hung in phase step "
        f"for {hung['silent_s']:.0f} s (no progress since step 9; stuck at {hung['frame']}): its "
        f"stacks are in {rank1_log}"
    ), restart[0]
    text = rank1_log.read_text()
    assert "rank_guard: stacks of the hung rank (all threads, most recent call first):" in text
    assert "in never_returns" in text and "in train_epoch" in text

    a = torch.load(ref.path, weights_only=True)["model"]
    b = torch.load(healthy.path, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "the restarted run's weights differ"
    assert time.monotonic() - started < 120


@pytest.mark.services
def test_a_hung_fsdp_rank_is_named_not_the_peer_waiting_in_its_all_gather(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    """Both ranks are silent in the same phase of the same step: rank 0 waits in the forward
    pass's all-gather (torch.distributed), rank 1 is stuck in the forward pass itself."""
    cfg = ClusterConfig(ranks_per_node=2, timeout_min=10, max_restarts=1)
    spec = _spec(dataset, tmp_path / "run", model="mlp", strategy="fsdp")
    job = HangingJob(spec, rank=1, at_step=10, marker=tmp_path / "m")
    log: list[str] = []
    ref, jobs = _train(job, cfg, tmp_path / "j", log)
    assert len(jobs) == 2 and isinstance(ref, CheckpointRef)
    hung = _exit(jobs[0], 1)["hung"]
    assert hung["phase"] == "step" and hung["frame"].endswith(" in never_returns")
    assert _exit(jobs[0], 0)["hung"] is None
    # Rank 0's guard, had it reached its allowance before rank 1's named rank 1 (the order is
    # the ranks' timing), left it to rank 1's guard; a loaded CI run saw it not reach it.
    rank0 = jobs[0].task(0).paths.stderr.read_text()
    assert "no progress for" not in rank0 or "waits in a collective level with rank 1" in rank0
    assert f"lost rank 1 (node {socket.gethostname()})" in log[0]


@pytest.mark.services
def test_a_hung_rank_of_a_tensor_parallel_group_is_named_not_its_peer(tmp_path: Path) -> None:
    """tp=2: both ranks compute every layer together, so rank 0 waits in the first split
    layer's collective while rank 1 is stuck in its forward pass; rank 1 is named and the job
    restarts to the end."""
    tokens = write_token_dataset(tmp_path / "ds", context=16, vocab=16, n_train=256, n_val=32)
    cfg = ClusterConfig(ranks_per_node=2, timeout_min=10, max_restarts=1)
    mesh: dict[str, Any] = {"strategy": "fsdp", "parallel": {"tp": 2}, "objective": "sequence"}
    spec = _spec(tokens, tmp_path / "run", model="transformer", **mesh)
    job = HangingJob(spec, rank=1, at_step=10, marker=tmp_path / "m")
    log: list[str] = []
    ref, jobs = _train(job, cfg, tmp_path / "j", log)
    assert len(jobs) == 2 and isinstance(ref, CheckpointRef)
    hung = _exit(jobs[0], 1)["hung"]
    assert hung["phase"] == "step" and hung["frame"].endswith(" in never_returns")
    assert _exit(jobs[0], 0)["hung"] is None
    assert f"lost rank 1 (node {socket.gethostname()})" in log[0]


@pytest.mark.services
@pytest.mark.parametrize("how", ["sleep", "spin", "read"])
def test_a_hung_single_rank_is_named_and_fails_with_no_restart_left(
    dataset: DatasetRef, tmp_path: Path, how: str
) -> None:
    cfg = ClusterConfig(ranks_per_node=1, timeout_min=10, max_restarts=0)
    # 8 steps an epoch: forward 20 is in epoch 3.
    spec = _spec(dataset, tmp_path / "run")
    job = HangingJob(spec, rank=0, at_step=20, marker=tmp_path / "m", how=how)
    started = time.monotonic()
    with pytest.raises(RankHungError) as failure:
        _train(job, cfg, tmp_path / "j", [])
    assert time.monotonic() - started < 90
    assert isinstance(failure.value, RankLostError)  # what cluster.restarts restarts
    message = str(failure.value)
    assert "rank 0 on node" in message and "hung in phase step" in message
    assert "(no progress since step 19; stuck at " in message
    assert " in never_returns): its stacks are in " in message
    assert message.endswith("; no restart left (cluster.max_restarts=0)")


@pytest.mark.services
def test_a_stopped_rank_is_named_with_its_stacks_and_the_job_restarts(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    """SIGSTOP: the rank neither runs nor dies; its guard resumes it to dump its stacks."""
    cfg = ClusterConfig(ranks_per_node=1, timeout_min=10, max_restarts=1)
    # Long enough that the rank, resumed to dump its stacks, cannot finish before its kill.
    job = TrainingJob(_spec(dataset, tmp_path / "run", epochs=100))
    submitted: list[submitit.Job[Any]] = []
    stopped: list[int] = []

    def stop_in_epoch_3(first: submitit.Job[Any]) -> None:
        """SIGSTOP the rank once its heartbeat says it is past step 16 (8 steps an epoch)."""
        beat_file = first.paths.folder / f"{first.job_id}_0_beat"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not first.done():
            beat = read_beat(beat_file)
            if beat is not None and beat.step >= 17:
                rank = first.paths.folder / f"{first.job_id}_0_rank.json"
                stopped.append(int(json.loads(rank.read_text())["pid"]))
                os.kill(stopped[0], signal.SIGSTOP)
                return
            time.sleep(0.005)

    def submit(exclude: list[str], nodes: int) -> submitit.Job[Any]:
        submitted.append(make_executor(cfg, tmp_path / "j").submit(job))
        if len(submitted) == 1:
            threading.Thread(target=stop_in_epoch_3, args=(submitted[0],), daemon=True).start()
        return submitted[-1]

    log: list[str] = []
    ref = run_with_restarts(
        cfg, submit, lambda j: wait_for_job(j, lambda line: None, poll_s=0.1), log.append
    )
    assert stopped and len(submitted) == 2 and isinstance(ref, CheckpointRef)
    hung = _exit(submitted[0], 0)["hung"]
    assert hung["phase"] in {"data", "step", "backward", "evaluation", "checkpoint"}
    assert hung["frame"] and HANG_S <= hung["silent_s"] < HANG_S + 5
    assert f"hung in phase {hung['phase']} for " in log[0] and f"stuck at {hung['frame']}" in log[0]
    text = submitted[0].task(0).paths.stderr.read_text()
    assert "stacks of the hung rank" in text and "(most recent call first):" in text


def test_the_stuck_frame_is_the_main_threads_innermost_own_code() -> None:
    dump = """Thread 0x00007fb3191fc6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/x/trainflow/tasks/train/checkpointing/recorder.py", line 40 in _run

Current thread 0x00007fb319e4cb80 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/autograd/graph.py", line 825 in _engine_run_backward
  File "/v/lib/python3.11/site-packages/torch/_tensor.py", line 626 in backward
  File "/x/trainflow/tasks/train/loop.py", line 106 in _train_step
  File "/x/trainflow/tasks/train/loop.py", line 135 in train_epoch
"""
    assert stuck_frame(dump) == (
        "trainflow/tasks/train/loop.py:106 in _train_step "
        "(in torch/autograd/graph.py:825 in _engine_run_backward)"
    )
    user = 'Current thread 0x1 (most recent call first):\n  File "/home/u/m.py", line 3 in f\n'
    assert stuck_frame(user) == "/home/u/m.py:3 in f"
    assert stuck_frame("") is None


def test_a_heartbeat_carries_the_phase_step_and_allowance(tmp_path: Path) -> None:
    path = tmp_path / "7_0_beat"
    beat = Heartbeat(path, timeout_s=5, first_s=50)
    beat.beat("start-up", 0)
    first = read_beat(path)
    assert first is not None and (first.phase, first.step, first.allowed_s) == ("start-up", 0, 50)
    beat.beat("data", 0)
    beat.beat("step")
    step = read_beat(path)
    assert step is not None and (step.phase, step.step, step.allowed_s) == ("step", 0, 50)
    beat.beat("data", 1)  # the first step is done: the shorter allowance from now on
    later = read_beat(path)
    assert later is not None and later.allowed_s == 5 and later.count == 4
    # The position a guard compares: an epoch's evaluation and checkpoint come after its steps.
    at = [Beat(1, 0.0, s, p, 1.0) for s, p in [(4, "backward"), (5, "evaluation"), (5, "data")]]
    assert sorted(at, key=position) == at
    Heartbeat(tmp_path / "off", timeout_s=0, first_s=50).beat("data", 0)
    assert not (tmp_path / "off").exists()


def test_a_hang_timeout_under_the_guards_poll_is_refused() -> None:
    with pytest.raises(ValueError, match=r"hang_timeout_s=1\.0 is shorter than"):
        TrainConfig(hang_timeout_s=1)
    assert TrainConfig(hang_timeout_s=0).hang_timeout_s == 0


def test_of_two_hung_ranks_the_one_silent_first_leads(tmp_path: Path) -> None:
    """Both ended as hung (neither seen waiting for the other): the first to stop is named."""
    from types import SimpleNamespace

    from trainflow.cluster.lost_ranks import RankEnd, failure_message

    def hung(task: int, since: float, ended: float) -> RankEnd:
        record = {
            "phase": "step",
            "step": 9,
            "silent_s": 3.2,
            "since": since,
            "frame": "f.py:1 in f",
        }
        log = tmp_path / f"5_{task}_log.err"
        return RankEnd(task, "vm", -9, False, None, None, ended, log, None, record)

    job: Any = SimpleNamespace(job_id="5", paths=SimpleNamespace(folder=tmp_path))
    found = failure_message(job, [hung(0, since=100.5, ended=104.0), hung(1, 100.0, 105.0)])
    assert found is not None
    assert found[0].startswith(
        "job 5 lost rank 1 (node vm): rank 1 on node vm hung in phase step for 3 s (no progress "
        f"since step 9; stuck at f.py:1 in f): its stacks are in {tmp_path}/5_1_log.err; rank 0 "
    ), found[0]


def test_a_functional_collectives_wait_counts_as_a_collective() -> None:
    """DTensor's collectives (tensor parallelism) wait in torch's op dispatcher called from
    torch.distributed._functional_collectives: the rank waits for a peer, it is not stuck."""
    site = "/venv/lib/python3.11/site-packages"
    dump = (
        "Current thread 0x01 (most recent call first):\n"
        f'  File "{site}/torch/_ops.py", line 1279 in __call__\n'
        f'  File "{site}/torch/distributed/_functional_collectives.py", line 142 in wait_tensor\n'
        '  File "/work/trainflow/tasks/train/transformer.py", line 87 in forward\n'
    )
    assert in_collective(dump)
    own = dump.replace(f"{site}/torch/distributed/_functional_collectives.py", "/work/mine.py")
    assert not in_collective(own)  # the dispatcher called from the user's code: not waiting
