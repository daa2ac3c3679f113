"""P10: what FSDP's bf16 policy costs in accuracy against DDP's, and what the alternative
(fp32 parameters under FSDP with autocast, computing as DDP does) costs in memory.

examples/charlm's transformer (width 256, 8 blocks) trains STEPS AdamW steps on the same
global batch, split over 2 gloo ranks, three ways:
- ddp: trainflow's wrap_ddp, bf16 autocast over fp32 weights (the bf16 policy under DDP);
- fsdp: trainflow's wrap_fsdp under the bf16 policy (parameters gathered in bf16, gradients
  reduced in fp32, fp32 master shards) inside the same autocast;
- fsdp-fp32-params: the same units sharded with fp32 parameters, inside the same autocast.
Per way: the loss of every step (relative difference to ddp's), and the bytes autograd keeps
from the forward pass for the backward pass (saved tensors: activations plus whatever copies
of the weights the forward made), counted once per storage, less the parameters themselves
(under FSDP those are freed after each block's forward and gathered again for its backward);
counted once the forward pass is done (what is then still held); of those, the weight copies:
saved tensors of a weight's shape that are not parameters.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from bench.ranks import run_ranks

DIM, LAYERS, HEADS, CONTEXT, VOCAB = 256, 8, 8, 64, 96
BATCH = 8
"""Samples per rank per step."""
STEPS = 8
WAYS = ("ddp", "fsdp", "fsdp-fp32-params")


def _rank(rank: int, world: int, port: int, way: str, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "charlm"))
    from char_transformer import build  # the example is a user's project, not a package

    from trainflow.tasks.spec import DataSpec
    from trainflow.tasks.train.distributed import DistContext, wrap_ddp
    from trainflow.tasks.train.precision import PrecisionPolicy
    from trainflow.tasks.train.sharding import device_mesh, sharding_units, wrap_fsdp

    torch.set_num_threads(1)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    spec = DataSpec((CONTEXT,), "int64", "sequence", VOCAB, (CONTEXT,))
    model: nn.Module = build(spec, dim=DIM, layers=LAYERS, heads=HEADS, dropout=0.0)
    shapes = [p.shape for p in model.parameters() if p.dim() == 2]
    policy = PrecisionPolicy("cpu", torch.bfloat16, False, "bf16")
    if way == "ddp":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model = wrap_ddp(model, ctx)
    elif way == "fsdp":
        model = wrap_fsdp(model, ctx, policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        mesh, fp32 = device_mesh(ctx), MixedPrecisionPolicy()
        for unit in sharding_units(model):
            fully_shard(unit, mesh=mesh, mp_policy=fp32)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=fp32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS, world * BATCH, CONTEXT + 1), generator=g)
    weight_shapes = {tuple(s) for s in shapes}
    losses, saved_bytes, copies_bytes = [], 0, 0
    for step in range(STEPS):
        batch = ids[step, rank * BATCH : (rank + 1) * BATCH]
        saved: list[tuple[torch.UntypedStorage, bool]] = []

        def pack(t: torch.Tensor, saved: list[Any] = saved) -> torch.Tensor:
            if not isinstance(t, nn.Parameter):  # a weight-shaped one: a cast copy of a weight
                saved.append((t.untyped_storage(), tuple(t.shape) in weight_shapes))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), policy.autocast():
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        if step == 0:  # what is still held once the forward pass is done (FSDP has freed the
            # gathered parameters by then: their storage is resized to nothing), once each
            held = {st.data_ptr(): (st.nbytes(), copy) for st, copy in saved if st.nbytes()}
            saved_bytes = sum(n for n, _ in held.values())
            copies_bytes = sum(n for n, copy in held.values() if copy)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    matmul = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "positions" not in n
    )
    record = {
        "losses": losses,
        "saved_bytes": saved_bytes,
        "weight_copies_bytes": copies_bytes,
        "matmul_params": matmul,
    }
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(records))


def _measure(way: str, world: int = 2) -> dict[str, Any]:
    records = run_ranks("bench.p10_fsdp_precision", world, [way], f"P10 {way}")
    return {
        "losses": records[0]["losses"],
        "saved_mib": max(r["saved_bytes"] for r in records) / 2**20,
        "weight_copies_mib": max(r["weight_copies_bytes"] for r in records) / 2**20,
        "matmul_params_per_rank": records[0]["matmul_params"],
    }


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Loss against ddp's and bytes saved for the backward pass, three ways, 2 ranks."""
    result: dict[str, Any] = {way: _measure(way) for way in WAYS}
    ddp = result["ddp"]["losses"]
    rows = []
    for way in WAYS:
        losses = result[way]["losses"]
        worst = max(abs(a - b) / b for a, b in zip(losses, ddp, strict=True))
        result[way]["max_rel_loss_diff_vs_ddp"] = worst
        rows.append(
            (
                f"{way}: loss after {STEPS} steps; max rel. diff to ddp; saved MiB/rank "
                "(of which weight copies)",
                f"{losses[-1]:.4f}; {worst:.1e}; {result[way]['saved_mib']:.1f} "
                f"({result[way]['weight_copies_mib']:.1f})",
                "",
            )
        )
    whole = 2 * sum(p.numel() for p in _matmul_weights()) / 2**20
    result["whole_model_matmul_weights_bf16_mib"] = whole
    rows.append(("the whole model's matmul weights in bf16, MiB", f"{whole:.1f}", ""))
    title = f"P10 FSDP bf16 policy vs DDP autocast (charlm {DIM}x{LAYERS}, 2 gloo ranks)"
    return title, rows, result


def _matmul_weights() -> list[torch.Tensor]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "charlm"))
    from char_transformer import build

    from trainflow.tasks.spec import DataSpec

    spec = DataSpec((CONTEXT,), "int64", "sequence", VOCAB, (CONTEXT,))
    model = build(spec, dim=DIM, layers=LAYERS, heads=HEADS, dropout=0.0)
    return [p for n, p in model.named_parameters() if p.dim() == 2 and "positions" not in n]


if __name__ == "__main__":
    rank_, world_, port_, way_, out_ = sys.argv[1:6]
    _rank(int(rank_), int(world_), int(port_), way_, out_)
