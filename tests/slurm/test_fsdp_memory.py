"""A model whose DDP rank does not fit in a memory limit trains under FSDP on 4 ranks (2 per node
of the 2-node dev Slurm) inside that limit per rank.

The dev Slurm runs no cgroup plugin, but each node's slurmd forks every step and task it runs:
the fixture moves each node's slurmd into a memory cgroup (v1) of its own, limited (memory and
memory+swap) to NODE_LIMIT, twice RANK_LIMIT (the node's RAM for its 2 ranks), and moves it
back and removes the groups afterwards. The job's ranks are forked inside their node's group
(each rank reports its cgroup), so the limit holds them for real: exceeding it would OOM-kill
a rank and fail the job.

The model: examples/charlm's transformer, width 512, 16 blocks: 50.5M parameters; in numbers
(DESIGN.md "Memory per rank") a DDP rank holds 16 bytes a parameter (fp32 weights, gradients,
AdamW's two moments) = 771 MiB before torch, gloo, the data, one activation or a checkpoint
copy. The test measures both sides under the same node groups: the same job with
train.strategy=ddp first, which must fail with an OOM kill in a group, then under fsdp, which
must finish with no further OOM kill, each rank's peak RSS (VmHWM) under RANK_LIMIT and each
group's peak usage (reset after the DDP job) within NODE_LIMIT.
"""

import json
import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import submitit

from tests.cgroups import V1, drain_and_remove, memory_group_of, own_memory_group
from tests.unit.datasets import write_token_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.dev.slurm import slurm_home
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import JobError
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.model_plugins import check_model
from trainflow.tasks.train.ref import CheckpointRef

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHARLM = Path(__file__).resolve().parents[2] / "examples" / "charlm"
RANK_LIMIT = 1024 << 20
NODE_LIMIT = 2 * RANK_LIMIT
CONTEXT, VOCAB = 64, 96


class ReportsMemory(TrainingJob):
    """Trains, then writes this rank's peak RSS (VmHWM) and memory cgroup to
    <out_dir>/memory-<rank>.json."""

    def __call__(self) -> CheckpointRef | None:
        result = super().__call__()
        rank = submitit.JobEnvironment().global_rank
        status = Path("/proc/self/status").read_text()
        hwm = re.search(r"VmHWM:\s+(\d+) kB", status)
        groups = Path("/proc/self/cgroup").read_text().splitlines()
        record = {
            "node": os.environ.get("SLURMD_NODENAME"),
            "vmhwm": int(hwm[1]) * 1024 if hwm else None,
            "cgroup": next(g.split(":", 2)[2] for g in groups if ":memory:" in g),
        }
        self.spec.out_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.out_dir / f"memory-{rank}.json").write_text(json.dumps(record))
        return result


def _memory_group_of(pid: int) -> Path:
    group = memory_group_of(pid)
    assert group is not None, f"process {pid} is in no memory cgroup"
    return group


@pytest.fixture
def node_groups() -> Iterator[dict[str, Path]]:
    """Each node's slurmd moved into a memory cgroup limited to NODE_LIMIT, by node name;
    moved back, and the groups removed, afterwards."""
    parent = own_memory_group()
    if parent is None:
        pytest.skip("needs root and a writable cgroup v1 memory controller")
    slurmds = {
        f.stem.removeprefix("slurmd-"): int(f.read_text())
        for f in sorted((slurm_home() / "run").glob("slurmd-*.pid"))
    }
    groups: dict[str, Path] = {}
    homes: dict[int, Path] = {}
    try:
        for node, pid in slurmds.items():
            group = parent / f"trainflow-fsdp-{node}-{uuid.uuid4().hex[:8]}"
            group.mkdir()
            groups[node] = group
            (group / "memory.limit_in_bytes").write_text(str(NODE_LIMIT))
            memsw = group / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(NODE_LIMIT))
            homes[pid] = _memory_group_of(pid)
            (group / "cgroup.procs").write_text(str(pid))
        yield groups
    finally:
        for pid, home in homes.items():
            (home / "cgroup.procs").write_text(str(pid))
        for group in groups.values():
            drain_and_remove(group)


def _oom_kills(group: Path) -> int:
    """OOM kills in `group` (memory.oom_control's oom_kill; 0 on kernels without it)."""
    fields = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return int(fields.get("oom_kill", 0))


def _peaks_and_kills(groups: dict[str, Path]) -> tuple[dict[str, int], int]:
    """Each group's peak usage since its last reset, and the OOM kills in all of them."""
    peaks = {n: int((g / "memory.max_usage_in_bytes").read_text()) for n, g in groups.items()}
    return peaks, sum(_oom_kills(g) for g in groups.values())


def _submit(train: TrainConfig, dataset: DatasetRef, out: Path, jobs: Path) -> Any:
    """ReportsMemory on 2 nodes x 2 ranks; the result of rank 0, or the JobError it failed with."""
    spec = TrainJobSpec(train=train, dataset=dataset, out_dir=out, code=[CHARLM])
    cluster = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=2, timeout_min=10)
    job = make_executor(cluster, jobs).submit(ReportsMemory(spec))
    try:
        return wait_for_job(job, print)
    except JobError as err:
        return err


def test_fsdp_trains_a_model_whose_ddp_rank_exceeds_the_per_rank_memory_limit(
    node_groups: dict[str, Path], tmp_path: Path
) -> None:
    world = 4
    dataset = write_token_dataset(tmp_path / "ds", CONTEXT, VOCAB, world * 4 * 2, world * 4)
    train = TrainConfig(
        model="char_transformer:build",
        model_args={"dim": 512, "layers": 16, "heads": 8, "dropout": 0.0},
        objective="sequence",
        strategy="ddp",
        epochs=1,
        batch_size=4,  # 2 steps an epoch
        precision="fp32",
        device="cpu",
    )
    sys.path.insert(0, str(CHARLM))
    try:
        params = check_model(train, dataset_spec(dataset, "sequence")).parameters
    finally:
        sys.path.remove(str(CHARLM))
    print(
        f"{params:,} parameters: {16 * params >> 20} MiB of fp32 state (16 bytes each) per DDP rank"
    )

    # DDP first, under the same limits: it must not fit (a rank OOM-killed, the job failed).
    ddp = _submit(train, dataset, tmp_path / "ddp", tmp_path / "jobs-ddp")
    ddp_peaks, ddp_kills = _peaks_and_kills(node_groups)
    print(f"ddp: {ddp_kills} OOM kill(s), node peaks {[p >> 20 for p in ddp_peaks.values()]} MiB")
    print(f"ddp: {ddp}")
    assert isinstance(ddp, JobError), f"a DDP rank of this model fits in the limit: {ddp}"
    assert ddp_kills > 0, f"the DDP job failed without an OOM kill: {ddp}"
    for group in node_groups.values():
        (group / "memory.max_usage_in_bytes").write_text("0")  # FSDP's own peak from here

    out = tmp_path / "run"
    result = _submit(train.model_copy(update={"strategy": "fsdp"}), dataset, out, tmp_path / "jobs")
    assert isinstance(result, CheckpointRef), result
    ranks: list[dict[str, Any]] = [
        json.loads((out / f"memory-{r}.json").read_text()) for r in range(world)
    ]
    for r, rank in enumerate(ranks):
        print(f"rank {r} on {rank['node']}: peak RSS {rank['vmhwm'] >> 20} MiB")
        group = node_groups[rank["node"]]
        assert V1 / rank["cgroup"].lstrip("/") == group, rank  # held by its node's limit
        assert rank["vmhwm"] < RANK_LIMIT, rank
    assert sorted(r["node"] for r in ranks) == sorted(2 * list(node_groups))
    peaks, kills = _peaks_and_kills(node_groups)
    assert kills == ddp_kills, "an FSDP rank was OOM-killed"
    for node, usage in peaks.items():
        print(f"{node}: fsdp peak usage {usage >> 20} MiB (page cache included)")
        assert usage <= NODE_LIMIT
