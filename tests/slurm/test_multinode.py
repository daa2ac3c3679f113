"""Training across the dev cluster's two nodes: DDP over nodes, a rank lost on one node, a node
set DOWN, and a restart that avoids the lost node.

Jobs go through sbatch/srun on tfnode1 and tfnode2 (tests/slurm/conftest.py starts 2 nodes);
the ranks rendezvous at the job's first node by name (the hosts line the cluster writes).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import cloudpickle
import psutil
import pytest
import submitit
import torch

from tests.gates import GatedJob
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.cluster.lost_ranks import RankLostError
from trainflow.errors import JobError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.task import train_with_restarts

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _spec(dataset: DatasetRef, out: Path, epochs: int, micro: bool = False) -> TrainJobSpec:
    # Global batch 32 whatever the layout: 2 ranks x 16 (batch_size is per rank), or with
    # `micro` 2 ranks x 2 micro-batches of 8 (gradient accumulation, DDP's no_sync).
    batch = {"batch_size": 8, "global_batch_size": 32} if micro else {"batch_size": 16}
    train = TrainConfig(epochs=epochs, device="cpu", precision="fp32", seed=7, **batch)
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out, tracking_uri=None, run_id=None)


def _executor(folder: Path, nodes: int, ranks_per_node: int) -> submitit.Executor:
    cfg = ClusterConfig(
        executor="slurm", nodes=nodes, ranks_per_node=ranks_per_node, timeout_min=10
    )
    return make_executor(cfg, folder)


def _sacct(job_id: str, fields: str) -> str:
    cmd = ["sacct", "-n", "-X", "-P", "-o", fields, "-j", job_id]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout


def test_two_nodes_by_one_rank_end_with_the_weights_of_one_node_by_two_ranks(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    """Each rank accumulates 2 micro-batches a step (DDP's no_sync in the first, the
    all-reduce in the second's backward), across nodes as within one."""
    across = _executor(tmp_path / "a", nodes=2, ranks_per_node=1).submit(
        TrainingJob(_spec(dataset, tmp_path / "across", epochs=2, micro=True))
    )
    within = _executor(tmp_path / "w", nodes=1, ranks_per_node=2).submit(
        TrainingJob(_spec(dataset, tmp_path / "within", epochs=2, micro=True))
    )
    lines: list[str] = []
    ref_across = wait_for_job(across, lines.append)
    ref_within = wait_for_job(within, lambda line: None)

    assert isinstance(ref_across, CheckpointRef) and isinstance(ref_within, CheckpointRef)
    assert any(line.startswith("[rank0@tfnode1] ") for line in lines), lines[:5]
    assert any("on 2 rank(s): device cpu, backend gloo" in line for line in lines)
    assert any("global batch 32: 2 ranks x 2 micro-batches of 8" in line for line in lines)
    a = torch.load(ref_across.path, weights_only=True)["model"]
    w = torch.load(ref_within.path, weights_only=True)["model"]
    # Bitwise: the same world of 2 ranks gets the same seed, shards and initial weights, and
    # gloo sums the same two float32 gradients whether the peer is on this node or another;
    # each rank computes with one thread (cpus_per_task=1) on the same CPU kernels.
    assert a.keys() == w.keys()
    assert all(torch.equal(a[k], w[k]) for k in a), "weights differ across layouts"
    assert _sacct(across.job_id, "State,NNodes,NodeList").strip() == "COMPLETED|2|tfnode[1-2]"


def _squeue(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout


def _rank_record(job: submitit.Job[object], task: int) -> dict[str, object]:
    path = job.paths.folder / f"{job.job_id}_{task}_rank.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    assert isinstance(data, dict)
    return data


def test_a_rank_killed_on_the_second_node_is_named_and_ends_the_job(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    job = _executor(tmp_path / "k", nodes=2, ranks_per_node=1).submit(
        TrainingJob(_spec(dataset, tmp_path / "run", epochs=500))
    )
    killed: list[float] = []
    pids: list[int] = []

    def kill_rank1_after_epoch_2(line: str) -> None:
        if not killed and "epoch 2/500" in line:
            record = _rank_record(job, 1)
            assert record["slurm_node"] == "tfnode2"
            pids.extend([int(str(record["pid"])), int(str(_rank_record(job, 0)["pid"]))])
            os.kill(pids[0], signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(JobError) as failure:
        wait_for_job(job, kill_rank1_after_epoch_2)
    assert killed, "training never reached epoch 2"
    assert time.monotonic() - killed[0] < 60  # the job ends, not torch's collective timeout
    head = str(failure.value).splitlines()[0]
    assert "lost rank 1 (node tfnode2): rank 1 on node tfnode2 was killed by signal 9" in head
    assert f"log: {job.paths.folder}/{job.job_id}_1_log.err" in head
    assert "----- rank 0 (node tfnode1) traceback -----" in failure.value.detail  # --debug
    assert not [pid for pid in pids if _alive(pid)], "a rank process outlived the job"
    assert not _squeue(job.job_id).strip()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_job_that_lost_a_node_restarts_on_the_other_node_to_the_same_weights(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    cfg = ClusterConfig(executor="slurm", nodes=1, ranks_per_node=2, timeout_min=10)
    assert cfg.max_restarts == 1  # the default
    plain = make_executor(cfg, tmp_path / "p").submit(
        TrainingJob(_spec(dataset, tmp_path / "plain", epochs=60))
    )
    killed: list[str] = []
    lines: list[str] = []
    job_dir = tmp_path / "k"

    def kill_after_epoch_2(line: str) -> None:
        lines.append(line)
        if not killed and "epoch 2/60" in line:
            record = json.loads(next(job_dir.glob("*_1_rank.json")).read_text())
            os.kill(int(record["pid"]), signal.SIGKILL)
            killed.append(str(record["slurm_node"]))

    warnings: list[str] = []
    spec = _spec(dataset, tmp_path / "lost", epochs=60)
    ref = train_with_restarts(spec, cfg, job_dir, tmp_path, kill_after_epoch_2, warnings.append)
    ref_plain = wait_for_job(plain, lambda line: None)

    assert killed and isinstance(ref, CheckpointRef) and isinstance(ref_plain, CheckpointRef)
    assert f"lost rank 1 (node {killed[0]})" in warnings[0]
    restarted = [ln for ln in lines if f"excluding node(s) {killed[0]}" in ln]
    assert restarted, lines
    second = re.findall(r"submitted training job (\d+)", "\n".join(lines))[-1]
    node = _sacct(second, "NodeList").strip()
    assert node in {"tfnode1", "tfnode2"} and node != killed[0]
    a = torch.load(ref.path, weights_only=True)["model"]
    b = torch.load(ref_plain.path, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "the restarted job's weights differ"


@contextmanager
def _node_down(node: str) -> Iterator[None]:
    """`scontrol update State=DOWN` on `node`; State=RESUME on the way out, so later tests have
    both nodes. The dev cluster's ReturnToService=2 puts a node whose slurmd answers back in
    service at once (measured: 16 ms later), so it is resumed only if it is still down."""
    cmd = ["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=trainflow-test"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    try:
        yield
    finally:
        sinfo = ["sinfo", "-h", "-N", "-n", node, "-o", "%T"]
        state = subprocess.run(sinfo, capture_output=True, text=True, timeout=30).stdout
        if "down" in state or "drain" in state:
            resume = ["scontrol", "update", f"NodeName={node}", "State=RESUME"]
            subprocess.run(resume, check=True, capture_output=True, timeout=30)


class _DownAtTheGate:
    """A log callback for a GatedJob held before epoch 3: once epoch 2 is logged (its checkpoint
    is written, the ranks wait at the gate), set the node of the last rank DOWN (until `stack`
    closes). When a restart is submitted, open the gate once every process of the lost job is
    gone (Slurm's own requeued attempt too, if it started: it waits at the same gate), so the
    test does not depend on how soon Slurm kills them."""

    def __init__(
        self,
        job_dir: Path,
        gate: Path,
        ranks: int,
        stack: ExitStack,
        then: Callable[[str], None] = lambda node: None,
    ) -> None:
        self.job_dir, self.gate, self.ranks, self.stack = job_dir, gate, ranks, stack
        self.then = then
        """Called with the node once it is DOWN."""
        self.lines: list[str] = []
        self.pids: set[int] = set()
        self.node = ""
        self.at = 0.0

    def note_pids(self) -> list[dict[str, object]]:
        """Add the pids (rank and guard) of every rank record in the job folder; the records."""
        records = [json.loads(p.read_text()) for p in sorted(self.job_dir.glob("*_rank.json"))]
        self.pids |= {int(r[key]) for r in records for key in ("pid", "guard_pid")}
        return records

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if self.node and line.startswith("submitted training job"):
            self.note_pids()
            assert not _gone(self.pids), "a rank process outlived the failed node"
            self.gate.touch()
        if self.node or not re.search(r"\] epoch 2/", line):
            return
        records = self.note_pids()
        assert len(records) == self.ranks, records
        self.node = str(records[-1]["slurm_node"])
        self.stack.enter_context(_node_down(self.node))
        self.at = time.monotonic()
        self.then(self.node)


def _gone(pids: set[int], guard_s: float = 120) -> list[int]:
    """The pids still alive once all have ended or `guard_s` (a guard against hangs) passed:
    Slurm kills a failed node's processes after KillWait (5 s on the dev cluster)."""
    deadline = time.monotonic() + guard_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [pid for pid in pids if _alive(pid)]


def test_a_node_set_down_mid_epoch_restarts_the_job_away_from_it_to_the_same_weights(
    dataset: DatasetRef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm 22.05 (measured here) ends a job on a node set DOWN with NODE_FAIL, requeues it
    (JobRequeue=1) and kills its processes after KillWait. trainflow sees NODE_FAIL, cancels
    the requeued job (it would run beside the restart), names the node from slurmdbd's node
    event, and restarts from the epoch-2 checkpoint excluding that node."""
    gate = tmp_path / "gate-3"
    monkeypatch.setattr(
        "trainflow.tasks.train.task.TrainingJob", lambda spec: GatedJob(spec, {3: gate})
    )
    cfg = ClusterConfig(executor="slurm", nodes=1, ranks_per_node=2, timeout_min=10)
    plain: list[submitit.Job[object]] = []

    def submit_plain(node: str) -> None:
        """The uninterrupted run, meanwhile, on the node that was not set down."""
        executor = make_executor(cfg, tmp_path / "p")
        executor.update_parameters(exclude=node)
        plain.append(executor.submit(TrainingJob(_spec(dataset, tmp_path / "plain", epochs=8))))

    warnings: list[str] = []
    with ExitStack() as stack:
        down = _DownAtTheGate(tmp_path / "k", gate, 2, stack, submit_plain)
        spec = _spec(dataset, tmp_path / "lost", epochs=8)
        ref = train_with_restarts(spec, cfg, tmp_path / "k", tmp_path, down, warnings.append)
    ref_plain = wait_for_job(plain[0], lambda line: None)

    assert down.node and isinstance(ref, CheckpointRef) and isinstance(ref_plain, CheckpointRef)
    assert (
        f"lost node {down.node}: Slurm ended it with NODE_FAIL (node {down.node} DOWN"
        in warnings[0]
    )
    assert "reason: trainflow-test" in warnings[0]
    assert [ln for ln in down.lines if f"excluding node(s) {down.node}" in ln], down.lines
    first, second = re.findall(r"submitted training job (\d+)", "\n".join(down.lines))
    assert _sacct(second, "NodeList").strip() not in {down.node, ""}
    assert not _squeue(first).strip(), "Slurm's requeued attempt was left queued"
    down.note_pids()  # the restarted job's ranks too
    assert not _gone(down.pids), "a rank process outlived the job"
    a = torch.load(ref.path, weights_only=True)["model"]
    b = torch.load(ref_plain.path, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "the restarted job's weights differ"


def test_a_node_set_down_with_no_restart_left_fails_the_job_naming_it(
    dataset: DatasetRef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate-3"
    monkeypatch.setattr(
        "trainflow.tasks.train.task.TrainingJob", lambda spec: GatedJob(spec, {3: gate})
    )
    cfg = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=1, timeout_min=10, max_restarts=0)
    warnings: list[str] = []
    with ExitStack() as stack, pytest.raises(RankLostError) as failure:
        down = _DownAtTheGate(tmp_path / "k", gate, 2, stack)
        spec = _spec(dataset, tmp_path / "lost", epochs=8)
        train_with_restarts(spec, cfg, tmp_path / "k", tmp_path, down, warnings.append)
    ended = time.monotonic()

    assert down.node == "tfnode2"  # the last rank of a 2-node job runs on the second node
    print(f"the job ended {ended - down.at:.1f} s after its node was set DOWN")
    assert ended - down.at < 60  # the job ends, not torch's collective timeout
    head = str(failure.value).splitlines()[0]
    assert "lost node tfnode2: Slurm ended it with NODE_FAIL (node tfnode2 DOWN" in head
    assert "reason: trainflow-test" in head and len(warnings) == 1
    assert head.startswith(warnings[0])  # the warning, then why the job ends: no restart
    assert "no restart left (cluster.max_restarts=0)" in str(failure.value)
    assert failure.value.nodes == ["tfnode2"]
    (job_id,) = re.findall(r"submitted training job (\d+)", "\n".join(down.lines))
    assert not _squeue(job_id).strip(), "Slurm's requeued attempt was left queued"
    down.note_pids()  # Slurm's requeued attempt's ranks, if it started before trainflow saw
    assert not _gone(down.pids), "a rank process outlived the failed node"
