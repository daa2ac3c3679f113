"""DDP bucket size and static_graph, measured: `python -m bench.ddp_buckets [STEPS]`.

Not part of `make bench`: a one-off measurement behind the `train.ddp_bucket_cap_mb` default
(~4 min on the 2-core CPU, where a resnet step takes 0.2-0.7 s). 2 gloo ranks on this
machine's CPU (one thread each), the reference CNN and the resnet on random MNIST-shaped
batches of 64 under the run's own precision policy. Each setting gets a fresh DDP wrapper;
settings are interleaved over ROUNDS rounds so that machine noise hits them alike, and the
table shows per-step medians with their spread.
"""

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.models import place_model
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.precision import resolve_precision

CAPS_MB = (1.0, 5.0, 25.0, 100.0)
"""Bucket caps tried (torch's default is 25)."""
ROUNDS = 3
"""Interleaved repetitions of every setting."""
BATCH = 64
"""Samples per rank per step."""


def _settings() -> list[tuple[str, float, bool]]:
    """(model, bucket cap, static_graph) of each measured setting."""
    rows = [(model, cap, True) for model in ("reference_cnn", "resnet") for cap in CAPS_MB]
    return rows + [(model, 25.0, False) for model in ("reference_cnn", "resnet")]


def _time_steps(ddp: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    """Median seconds per step over `steps` steps after 3 warm-up steps."""
    policy = resolve_precision("auto", torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 1, 28, 28, generator=gen).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        with policy.autocast():
            loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, port: int, steps: int, out: Any) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for model_name, cap, static in _settings():
            cfg = TrainConfig(model=model_name, device="cpu")
            torch.manual_seed(0)
            model = place_model(
                build_model(cfg, image_classification((1, 28, 28), 10)), cfg, torch.device("cpu")
            )
            opt = make_optimizer(cfg, model)
            ddp = DistributedDataParallel(
                model, gradient_as_bucket_view=True, bucket_cap_mb=cap, static_graph=static
            )
            key = f"{model_name} cap={cap:g}MB static_graph={static}"
            results.setdefault(key, []).append(_time_steps(ddp, opt, steps))
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """Measure every setting; print median ms/step, the spread over rounds, and the ratio."""
    steps = int(argv[0]) if argv else 15
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29_500 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank, args=(r, port, steps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[str, list[float]] = queue.get()
    for p in procs:
        p.join()
    print(f"{'setting':<45} {'median ms/step':>15} {'min..max over rounds':>22}")
    for key, values in results.items():
        ms = [v * 1e3 for v in values]
        spread = f"{min(ms):.2f}..{max(ms):.2f}"
        print(f"{key:<45} {statistics.median(ms):>15.2f} {spread:>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
