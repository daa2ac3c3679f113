"""P14: memory per rank on a device mesh (train.parallel): the training state under
tp x dp_shard, and the activations tensor parallelism with sequence parallelism keeps.

The built-in transformer (`train.model=transformer`: width 256, 4 blocks, 8 heads, a
synthetic vocabulary of VOCAB tokens) takes one fp32 AdamW step on real gloo ranks (one
process and one thread each), placed as trainflow's job places it (the mesh of
tasks.train.parallel.mesh, build_on_rank and shard_from_rank0 under fsdp, wrap_ddp under ddp),
each rank with the same micro-batch (BATCH sequences of CONTEXT tokens; a tensor-parallel
group's ranks share theirs). Per rank:
- training state: the bytes of the parameters, gradients and AdamW state this rank holds after
  the step (a DTensor's local shard, numel x element size; exact, not RSS), against a
  one-rank run's. Goal at tp x dp = 4: within 1/4 + 10% of one rank's. Also the parameters
  whose gradient this rank holds more of than of the weight (a shard's gradient kept whole).
- activations: the bytes autograd keeps from the forward pass (loss included) for the
  backward pass, counted once the forward pass is done: the saved tensors, seen through
  torch.autograd.graph.saved_tensors_hooks, each storage once (a DTensor's local one), less
  the parameters' own storages (weights autograd saves for the backward pass, and FSDP's
  gathered weights, freed by then under resharding). On CPU torch has no allocator statistics
  (torch.cuda.memory_allocated and its peak are CUDA's), and RSS mixes the activations with
  malloc's caching, gloo's buffers and the gathered weights; the saved tensors are exactly
  what the backward pass needs kept, whatever the device. Goal: tp=2 with sequence
  parallelism below dp_shard=2 (and DDP on 2) at the same micro-batch. As a cross-check, the
  growth over the forward pass of the bytes glibc's malloc (under torch's CPU allocator) has
  handed out and not had back (malloc_in_use).
"""

import ctypes
import gc
import json
import sys
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.ranks import run_ranks

DIM, LAYERS, HEADS, VOCAB, CONTEXT = 256, 4, 8, 512, 256
BATCH = 4
"""Sequences per rank (per tensor-parallel group) per step: the micro-batch."""
WAYS: dict[str, tuple[str, int, dict[str, int]]] = {
    "one rank": ("ddp", 1, {}),
    "ddp 2": ("ddp", 2, {}),
    "dp_shard=2": ("fsdp", 2, {"dp_shard": 2}),
    "tp=2": ("fsdp", 2, {"dp_shard": 1, "tp": 2}),
    "dp_shard=4": ("fsdp", 4, {"dp_shard": 4}),
    "tp=4": ("fsdp", 4, {"dp_shard": 1, "tp": 4}),
    "dp_shard=2 x tp=2": ("fsdp", 4, {"dp_shard": 2, "tp": 2}),
}
"""Each way: train.strategy, ranks, train.parallel."""
GOAL_STATE = 0.275
"""Training state per rank at tp x dp = 4 over one rank's: 1/4 + 10%."""


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of `tensors`: a DTensor's local shard, a tensor's whole."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def held_bytes(saved: Iterable[torch.Tensor], params: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages of `saved` (a DTensor's local one), each once, less the
    storages of `params` and the storages already freed (FSDP's resharded weights)."""
    own = {s.data_ptr() for p in params for s in storages(p)}
    held = {}
    for t in saved:
        for storage in storages(t):
            if storage.nbytes() and storage.data_ptr() not in own:
                held[storage.data_ptr()] = storage.nbytes()
    return sum(held.values())


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding `t`'s data: its own, or for a tensor subclass that wraps others
    (a DTensor its local shard, which may itself be the pending result of a collective) those
    of the tensors it wraps, as torch's subclass protocol (`__tensor_flatten__`) names them."""
    if not hasattr(t, "__tensor_flatten__"):
        return [t.untyped_storage()]
    inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]  # a DTensor's: its mesh too
    return [s for i in inner if isinstance(i, torch.Tensor) for s in storages(i)]


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h, glibc 2.33+): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks"),
            *("uordblks", "fordblks", "keepcost"),
        )
    ]


def malloc_in_use() -> int:
    """Bytes the C allocator (glibc malloc, which torch's CPU allocator calls) has handed out
    and not had back, over all its arenas: in use in its heaps plus mmapped blocks; -1 where
    the C library has no mallinfo2 (not glibc, or older than 2.33)."""
    gc.collect()
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return -1
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _placed(ctx: Any, way: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The transformer built, split and sharded as the job does for `way`, and its AdamW."""
    from trainflow.tasks.spec import DataSpec
    from trainflow.tasks.train.distributed import wrap_ddp
    from trainflow.tasks.train.precision import PrecisionPolicy
    from trainflow.tasks.train.sharded_init import build_on_rank, shard_from_rank0
    from trainflow.tasks.train.transformer import transformer

    strategy = WAYS[way][0]
    torch.manual_seed(0)
    spec = DataSpec((CONTEXT,), "int64", "sequence", VOCAB, (CONTEXT,))
    model = build_on_rank(
        lambda: transformer(spec, dim=DIM, layers=LAYERS, heads=HEADS), strategy, ctx
    )
    if strategy == "fsdp":
        model = shard_from_rank0(model, ctx, PrecisionPolicy("cpu", None, False, "fp32"))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return wrap_ddp(model, ctx), optimizer


def _rank(rank: int, world: int, port: int, way: str, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainflow.tasks.train.distributed import DistContext
    from trainflow.tasks.train.parallel.layout import ParallelConfig, mesh_shape
    from trainflow.tasks.train.parallel.mesh import on_mesh

    strategy, _, parallel = WAYS[way]
    torch.set_num_threads(1)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo" if world > 1 else None)
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        if strategy == "fsdp":
            ctx = on_mesh(ctx, mesh_shape(ParallelConfig(**parallel), world))
    model, optimizer = _placed(ctx, way)
    generator = torch.Generator().manual_seed(ctx.dp_rank)  # a tp group shares its batch
    ids = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=generator)
    saved: list[torch.Tensor] = []
    before = malloc_in_use()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    grown = malloc_in_use() - before if before >= 0 else -1
    activations = held_bytes(saved, list(model.parameters()))
    saved.clear()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    record = {
        "params": sum(p.numel() for p in params) if world == 1 else 0,
        "parameter_bytes": local_bytes(params),
        "gradient_bytes": local_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_bytes": local_bytes(
            [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        ),
        "activation_bytes": activations,
        "malloc_growth_bytes": grown,
        "loss": float(loss.detach()),
        "gradients_larger_than_their_weight": [
            name
            for name, p in model.named_parameters()
            if p.grad is not None and local_bytes([p.grad]) > local_bytes([p])
        ],
    }
    records: list[Any] = [record]
    if world > 1:
        records = [None] * world
        dist.all_gather_object(records, record)
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(records))


def _measure(way: str) -> dict[str, Any]:
    """One way's ranks run; the largest rank's figures in MiB, and every rank's record."""
    world = WAYS[way][1]
    records = run_ranks("bench.p14_mesh_memory", world, [way], f"P14 {way}")
    for r in records:
        r["state_bytes"] = r["parameter_bytes"] + r["gradient_bytes"] + r["optimizer_bytes"]
    keys = ("state", "parameter", "gradient", "optimizer", "activation", "malloc_growth")
    return {
        "ranks": world,
        "params": records[0]["params"],
        **{f"{k}_mib": max(r[f"{k}_bytes"] for r in records) / 2**20 for k in keys},
        "per_rank": records,
    }


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Training state and activations per rank, each way of WAYS; their ratios to one rank's."""
    result: dict[str, Any] = {way: _measure(way) for way in WAYS}
    one = result["one rank"]
    rows = [(f"parameters (transformer {DIM}x{LAYERS})", f"{one['params'] / 1e6:.2f}M", "")]
    for way, r in result.items():
        r["state_ratio"] = r["state_mib"] / one["state_mib"]
        r["activation_ratio"] = r["activation_mib"] / one["activation_mib"]
        goal = {"dp_shard=2 x tp=2": f"<= {GOAL_STATE} (1/4 + 10%)"}.get(way, "")
        rows.append(
            (
                f"{way}: state MiB/rank (params/grads/AdamW); / one rank's",
                f"{r['state_mib']:.2f} ({r['parameter_mib']:.2f}/{r['gradient_mib']:.2f}/"
                f"{r['optimizer_mib']:.2f}); {r['state_ratio']:.3f}",
                goal + (" met" if goal and r["state_ratio"] <= GOAL_STATE else ""),
            )
        )
        rows.append(
            (
                f"  {way}: activations MiB/rank; / one rank's; malloc growth MiB",
                f"{r['activation_mib']:.2f}; {r['activation_ratio']:.3f}; "
                f"{r['malloc_growth_mib']:.2f}",
                "",
            )
        )
    for way in ("ddp 2", "dp_shard=2"):
        ratio = result["tp=2"]["activation_mib"] / result[way]["activation_mib"]
        result[f"tp=2 / {way}: activations"] = ratio
        rows.append((f"tp=2 / {way}: activations", f"{ratio:.3f}", "< 1" + " met" * (ratio < 1)))
    title = f"P14 memory per rank on a mesh (transformer {DIM}x{LAYERS}, T={CONTEXT}, fp32 AdamW)"
    return title, rows, result


if __name__ == "__main__":
    rank_, world_, port_, way_, out_ = sys.argv[1:6]
    _rank(int(rank_), int(world_), int(port_), way_, out_)
