"""A lost rank is named: which rank, on which node, how it ended and where its log is.

Real local jobs of two gloo ranks (submitit's local executor, each rank under
cluster.rank_guard): one rank is killed with SIGKILL, or raises, while the other waits in an
all-reduce.
"""

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import submitit
import torch
import torch.distributed as dist

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.cluster.lost_ranks import RankLostError, raised_line
from trainflow.errors import JobError
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import distributed
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec

pytestmark = pytest.mark.timeout(120)


def _all_reduce_until(fail_rank: int | None, linger_s: float = 0.0) -> int:
    """Two ranks all-reduce in a loop; `fail_rank` raises at step 3, after leaving the group
    it lingers `linger_s` before its exception ends it. Runs ~forever otherwise."""
    try:
        with distributed("cpu") as ctx:
            for step in range(100_000):
                if step == 3 and ctx.rank == fail_rank:
                    raise ValueError(f"rank {ctx.rank} broke on purpose")
                dist.all_reduce(torch.ones(1))
                print(f"step {step}", flush=True)
                time.sleep(0.05)
    except ValueError:
        time.sleep(linger_s)
        raise
    return 0


def _submit(tmp_path: Path, fail_rank: int | None, linger_s: float = 0.0) -> submitit.Job[int]:
    executor = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), tmp_path / "jobs")
    return executor.submit(_all_reduce_until, fail_rank, linger_s)


def _rank_record(job: submitit.Job[Any], task: int) -> dict[str, object]:
    path = job.paths.folder / f"{job.job_id}_{task}_rank.json"
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline and not job.done(), "rank never started"
        time.sleep(0.1)
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


@pytest.mark.services
def test_a_killed_rank_is_named_with_its_signal_node_and_log(tmp_path: Path) -> None:
    job = _submit(tmp_path, fail_rank=None)
    lines: list[str] = []

    def kill_rank1_once_stepping(line: str) -> None:
        lines.append(line)
        if line.startswith("[rank1] step 2") and not killed:
            pid = int(str(_rank_record(job, 1)["pid"]))
            ranks.extend([pid, int(str(_rank_record(job, 0)["pid"]))])
            os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())

    killed: list[float] = []
    ranks: list[int] = []
    with pytest.raises(JobError) as failure:
        wait_for_job(job, kill_rank1_once_stepping, poll_s=0.1)
    assert killed, "rank 1 never reached step 2"
    assert time.monotonic() - killed[0] < 60  # not torch's collective timeout
    message = str(failure.value)
    head = message.splitlines()[0]
    assert f"lost rank 1 (node {socket.gethostname()})" in head
    assert "was killed by signal 9 (SIGKILL)" in head
    assert f"log: {job.paths.folder}/{job.job_id}_1_log.err" in head
    # Rank 0's collective error follows, its traceback in the detail.
    assert "; then rank(s) [0] failed" in head
    assert "----- rank 0 (node" in failure.value.detail
    assert not any(psutil.pid_exists(pid) and _alive(pid) for pid in ranks)
    # The guard dies of the same signal, quietly: no traceback of its own in rank 1's log.
    assert not [line for line in lines if line.startswith("[rank1] Traceback")], lines[-20:]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.services
def test_a_rank_that_raises_is_named_with_what_it_raised_node_and_log(tmp_path: Path) -> None:
    # The raising rank ends 3 s after its peer (whose all-reduce lost it): the cause still leads.
    job = _submit(tmp_path, fail_rank=1, linger_s=3.0)
    with pytest.raises(JobError) as failure:
        wait_for_job(job, lambda line: None, poll_s=0.1)
    message = str(failure.value)
    assert "\n" not in message  # one line: the tracebacks are the error's detail
    assert message.startswith(f"job {job.job_id} failed in rank 1, then rank(s) [0]: ")
    log = f"{job.paths.folder}/{job.job_id}_1_log.err"
    host = socket.gethostname()
    raised = "raised ValueError: rank 1 broke on purpose"
    assert message.endswith(f"rank 1 on node {host} {raised}, log: {log}")
    assert "lost rank" not in message  # a rank that raised is no lost rank
    detail = failure.value.detail
    assert detail.index("----- rank 1 (node") < detail.index("----- rank 0 (node")
    assert "in _all_reduce_until" in detail and detail.endswith(f"logs: {job.paths.folder}")
    assert "Traceback" in Path(log).read_text()  # and the rank's log keeps it


def test_the_raised_line_is_the_last_exception_of_a_traceback() -> None:
    chained = """Traceback (most recent call last):
  File "/x/data.py", line 10, in open_npy
    return np.load(file)
           ^^^^^^^^^^^^^
OSError: [Errno 24] Too many open files

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/job.py", line 3, in __call__
    raise DataError(msg) from exc
trainflow.errors.DataError: cannot read shard '/d/train-00001.x.npy': too many
"""
    assert raised_line(chained) == "DataError: cannot read shard '/d/train-00001.x.npy': too many"
    assert raised_line(chained + "files open\n") == (
        "DataError: cannot read shard '/d/train-00001.x.npy': too many (more in the log)"
    )
    interrupted = "Traceback (most recent call last):\n  File 'a', line 1\nKeyboardInterrupt"
    assert raised_line(interrupted) == "KeyboardInterrupt"
    assert raised_line(None) == "an exception (no traceback recorded)"


def _peer_timeout() -> float:
    from trainflow.tasks.train.distributed import peer_timeout

    return peer_timeout().total_seconds()


@pytest.mark.services
def test_each_rank_gets_the_configured_peer_timeout(tmp_path: Path) -> None:
    cfg = ClusterConfig(ranks_per_node=1, timeout_min=5, peer_timeout_s=17)
    job = make_executor(cfg, tmp_path / "jobs").submit(_peer_timeout)
    assert wait_for_job(job, lambda line: None, poll_s=0.1) == 17


def _return_then_hang() -> int:
    """Returns its result, then never exits: a non-daemon thread keeps the interpreter alive,
    as a deadlocked destructor would."""
    import threading

    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    return 42


@pytest.mark.services
def test_a_rank_stuck_after_writing_its_result_is_ended_by_its_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINFLOW_HUNG_AFTER_RESULT_S", "2")
    cfg = ClusterConfig(ranks_per_node=1, timeout_min=5)
    job = make_executor(cfg, tmp_path / "jobs").submit(_return_then_hang)
    start = time.monotonic()
    assert wait_for_job(job, lambda line: None, poll_s=0.1) == 42
    assert time.monotonic() - start < 60  # not the job's 5-minute limit
    ended = json.loads((job.paths.folder / f"{job.job_id}_0_exit.json").read_text())
    assert ended["hung_after_result"] is True and ended["returncode"] == 0
    assert "has not exited (stuck in teardown): killing it" in job.paths.stderr.read_text()


@pytest.mark.services
def test_a_result_left_by_an_earlier_attempt_does_not_end_a_requeued_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A requeued job's ranks find the result files of the attempt before (rank 1's error when
    Slurm stopped it): the guard must not take one for the live rank's and kill it."""
    import subprocess

    from trainflow.cluster import rank_guard

    monkeypatch.setattr(rank_guard, "HUNG_AFTER_RESULT_S", 0.5)
    stale = tmp_path / "37_1_result.pkl"
    submitit.core.utils.cloudpickle_dump(("error", "Traceback: stopped by the requeue"), stale)
    os.utime(stale, (time.time() - 60, time.time() - 60))
    started = time.time()
    child = subprocess.Popen(["sleep", "3"])
    assert rank_guard._wait(child, stale, started) == (0, False, None)


@pytest.mark.services
def test_a_killed_fsdp_rank_ends_the_job_in_seconds_named(tmp_path: Path) -> None:
    # FSDP's collectives (all-gathers in forward and backward, reduce-scatters, the sharded
    # checkpoint's) see the lost peer as a closed connection, as DDP's all-reduce does.
    spec = TrainJobSpec(
        train=TrainConfig(model="mlp", strategy="fsdp", epochs=1000, batch_size=32, device="cpu"),
        dataset=write_dataset(tmp_path / "data"),
        out_dir=tmp_path / "run",
    )
    executor = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), tmp_path / "jobs")
    job = executor.submit(TrainingJob(spec))
    killed: list[float] = []

    def kill_rank1_once_training(line: str) -> None:
        if line.startswith("[rank0] epoch 2/") and not killed:
            os.kill(int(str(_rank_record(job, 1)["pid"])), signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(JobError) as failure:
        wait_for_job(job, kill_rank1_once_training, poll_s=0.1)
    assert killed, "rank 0 never finished epoch 2"
    assert time.monotonic() - killed[0] < 60  # not torch's collective timeout (5 minutes)
    head = str(failure.value).splitlines()[0]
    assert f"lost rank 1 (node {socket.gethostname()})" in head
    assert "was killed by signal 9 (SIGKILL)" in head


def _die_or_hang() -> int:
    """Rank 1 is killed (SIGKILL) a moment in; rank 0 never ends by itself: a survivor blocked
    in something that does not notice the loss (seen: two FSDP ranks waiting on each other in
    an all-gather until gloo's timeout after a third was killed)."""
    if submitit.JobEnvironment().global_rank == 1:
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)
    return 0


@pytest.mark.services
@pytest.mark.timeout(120)
def test_a_survivor_that_would_wait_forever_is_ended_by_its_guard_after_a_peer_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINFLOW_PEER_GRACE_S", "2")
    job = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), tmp_path / "jobs").submit(
        _die_or_hang
    )
    with pytest.raises(JobError) as failure:
        wait_for_job(job, lambda line: None, poll_s=0.1)
    head = str(failure.value).splitlines()[0]
    assert f"lost rank 1 (node {socket.gethostname()})" in head, head
    assert "was killed by signal 9 (SIGKILL)" in head and "lost rank 0" not in head
    survivor = json.loads((job.paths.folder / f"{job.job_id}_0_exit.json").read_text())
    assert survivor["ended_for_peer"] == 1 and survivor["signal"] == "SIGKILL"
    assert "rank_guard: rank 1 of this job ended (SIGKILL)" in job.task(0).paths.stderr.read_text()
    assert isinstance(failure.value, RankLostError)  # what cluster.restarts restarts
    assert [e.task for e in failure.value.lost] == [1]


def test_a_peer_record_of_an_earlier_attempt_or_a_success_ends_no_rank(tmp_path: Path) -> None:
    from trainflow.cluster.rank_guard import ended_peer

    now = time.time()
    for task, code, ended in [(1, -9, now - 60), (2, 0, now + 1), (3, 1, now + 1)]:
        record = {"task": task, "returncode": code, "ended": ended, "hung_after_result": False}
        (tmp_path / f"7_{task}_exit.json").write_text(json.dumps(record))
    (tmp_path / "77_4_exit.json").write_text(
        json.dumps({"task": 4, "returncode": -9, "ended": now})
    )
    assert ended_peer(tmp_path, "7", 3, now) is None  # its own record is not a peer's
    found = ended_peer(tmp_path, "7", 0, now)
    assert found is not None and found["task"] == 3  # not the earlier attempt's, nor the success
    assert ended_peer(tmp_path, "7", 0, now + 10) is None
