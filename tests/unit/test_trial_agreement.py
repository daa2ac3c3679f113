"""A search trial's pruning decision (rank 0's) reaches every rank of a mesh: with tp=2 the
metric sums' all-reduce covers only the ranks of one tp coordinate, so a decision passed
through it would leave rank 1 and rank 3 training on while 0 and 2 stop (4 gloo ranks)."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainflow.tasks.search.trial_worker import _agree
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.parallel.layout import MeshShape
from trainflow.tasks.train.parallel.mesh import on_mesh


def _rank(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ctx = DistContext(rank, world, 0, torch.device("cpu"), "gloo")
        ctx = on_mesh(ctx, MeshShape(dp_shard=2, tp=2))
        decided = [_agree(True, ctx), _agree(False, ctx)]  # rank 0 says stop, then go on
        Path(out, f"{rank}.txt").write_text(repr(decided))
    finally:
        dist.destroy_process_group()


def test_rank_0s_decision_reaches_every_rank_of_a_tp_mesh(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(4, str(tmp_path / "store"), str(tmp_path)), nprocs=4)
    for rank in range(4):
        assert (tmp_path / f"{rank}.txt").read_text() == "[True, False]", rank
