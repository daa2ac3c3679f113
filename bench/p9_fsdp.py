"""P9: memory per rank and step time of train.strategy=fsdp against ddp, at 1, 2 and 4 ranks.

A ~50M-parameter model (examples/charlm's transformer: width 512, 16 blocks) trains a few
AdamW steps in fp32 on real gloo ranks (one process each, one thread each), wrapped by
trainflow's own wrap_ddp / wrap_fsdp. Per rank:
- model state: the bytes of the parameters, gradients and AdamW state this rank holds (its
  local shards under FSDP). Goal: FSDP at N ranks <= DDP's / N + 10%.
- peak RSS (VmHWM) over the rank's start (torch imported, group joined), rank 0 and the
  highest of the others apart: under FSDP rank 0 builds the whole model and the others build
  it on the meta device and receive their shards by broadcast (tasks.train.sharded_init, as
  the training job does), so only rank 0 ever holds the whole model.
- step time: the median of STEPS steps after one warm-up, the same per-rank batch for both.
On CPU, gloo has no reduce-scatter of its own (an all-reduce underneath: twice the traffic)
and FSDP all-gathers every block twice a step, so its step-time ratio says little about GPUs.
"""

import json
import os
import re
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from bench.ranks import run_ranks

DIM, LAYERS, HEADS, CONTEXT, VOCAB = 512, 16, 8, 32, 96
BATCH = 4
"""Samples per rank per step."""
STEPS = 3
RANKS = (1, 2, 4)


def _rss_bytes() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss may keep a parent's across exec)."""
    match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(match[1]) * 1024 if match else 0


def _rank(rank: int, world: int, port: int, strategy: str, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "charlm"))
    from char_transformer import build  # the example is a user's project, not a package

    from trainflow.tasks.spec import DataSpec
    from trainflow.tasks.train.distributed import DistContext, wrap_ddp
    from trainflow.tasks.train.precision import PrecisionPolicy
    from trainflow.tasks.train.sharded_init import build_on_rank, shard_from_rank0
    from trainflow.tasks.train.sharding import local_numel

    torch.set_num_threads(1)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo" if world > 1 else None)
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    base = _current_rss()
    torch.manual_seed(0)
    spec = DataSpec((CONTEXT,), "int64", "sequence", VOCAB, (CONTEXT,))
    model = build_on_rank(
        lambda: build(spec, dim=DIM, layers=LAYERS, heads=HEADS, dropout=0.0), strategy, ctx
    )
    params = sum(p.numel() for p in model.parameters())
    fp32 = PrecisionPolicy("cpu", None, False, "fp32")
    if strategy == "fsdp":
        model = shard_from_rank0(model, ctx, fp32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model = wrap_ddp(model, ctx)
    ids = torch.randint(
        0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(rank)
    )
    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    model_state = 4 * (local_numel(model.parameters()) + local_numel(grads) + local_numel(state))
    record = {
        "params": params,
        "model_state_bytes": model_state,
        "peak_rss_over_start_bytes": _rss_bytes() - base,
        "step_s": statistics.median(times[1:]),
    }
    if world > 1:
        records: list[Any] = [None] * world
        dist.all_gather_object(records, record)
        dist.destroy_process_group()
    else:
        records = [record]
    if rank == 0:
        Path(out).write_text(json.dumps(records))


def _current_rss() -> int:
    """This process's resident memory now (not the peak): /proc/self/statm."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _measure(strategy: str, world: int) -> dict[str, Any]:
    records = run_ranks("bench.p9_fsdp", world, [strategy], f"P9 {strategy} on {world} ranks")
    return {
        "params": records[0]["params"],
        "model_state_mib": max(r["model_state_bytes"] for r in records) / 2**20,
        "peak_rss_mib": records[0]["peak_rss_over_start_bytes"] / 2**20,
        "peak_rss_others_mib": max((r["peak_rss_over_start_bytes"] for r in records[1:]), default=0)
        / 2**20,
        "step_s": statistics.median(r["step_s"] for r in records),
    }


def _load_and_cpu() -> dict[str, str]:
    load = Path("/proc/loadavg").read_text().split()[:3]
    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "unknown",
    )
    flags = Path("/proc/cpuinfo").read_text()
    return {"load": " ".join(load), "cpu": model, "avx512_bf16": str("avx512_bf16" in flags)}


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Memory per rank and step time, ddp vs fsdp, at 1, 2 and 4 ranks."""
    before = _load_and_cpu()
    result: dict[str, Any] = {"before": before}
    for world in RANKS:
        for strategy in ("ddp", "fsdp"):
            result[f"{strategy}-{world}"] = _measure(strategy, world)
    result["load_after"] = _load_and_cpu()["load"]
    params = result["ddp-1"]["params"]
    rows = [(f"model parameters (charlm {DIM}x{LAYERS})", f"{params / 1e6:.1f}M", "50-100M")]
    for world in RANKS:
        ddp, fsdp = result[f"ddp-{world}"], result[f"fsdp-{world}"]
        goal = ddp["model_state_mib"] / world * 1.1
        rows += [
            (
                f"model state MiB/rank ddp/fsdp, {world} rank(s)",
                f"{ddp['model_state_mib']:.0f}/{fsdp['model_state_mib']:.0f}",
                f"fsdp <= {goal:.0f}",
            ),
            (
                f"  peak RSS MiB ddp/fsdp, {world} rank(s): rank 0; the others (max)",
                f"{ddp['peak_rss_mib']:.0f}/{fsdp['peak_rss_mib']:.0f}"
                + (
                    f"; {ddp['peak_rss_others_mib']:.0f}/{fsdp['peak_rss_others_mib']:.0f}"
                    if world > 1
                    else ""
                ),
                "",
            ),
            (
                f"  step s ddp/fsdp (ratio), {world} rank(s)",
                f"{ddp['step_s']:.2f}/{fsdp['step_s']:.2f} ({fsdp['step_s'] / ddp['step_s']:.2f})",
                "report",
            ),
        ]
    rows.append(
        ("load before / after; CPU", f"{before['load']} / {result['load_after']}", before["cpu"])
    )
    return "P9 memory per rank and step time: ddp vs fsdp (fp32, gloo)", rows, result


if __name__ == "__main__":
    rank_, world_, port_, strategy_, out_ = sys.argv[1:6]
    _rank(int(rank_), int(world_), int(port_), strategy_, out_)
