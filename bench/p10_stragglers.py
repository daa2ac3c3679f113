"""P10: the cost of straggler detection: step time with per-step timing and the window
all-gathers over step time without (goal <= 1.01).

Two gloo ranks (one thread each, the 2-core CPU), the default config's model, precision and
batch on random MNIST-shaped data, DDP as the training job wraps it. Epochs with and without
the step timer (tasks.train.step_times, its hooks on the model, judged on rank 0 by a
StragglerWatch as in a job) alternate in the same processes on the same model, so both see
the same machine noise: once with the default window (50 steps) and once with windows of 5
steps (ten times the all-gathers). Also measured: one all-gather of a window's four numbers
alone, which a window costs once; and, in one process (a DDP group of one, so that the timer's
hooks are on), the timer's own cost a step, blocks of 16 steps with and without it alternating
(a finer comparison than whole epochs of two ranks on a loaded machine).
"""

import os
import socket
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from trainflow.tasks.objectives.classification import Classification
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import Split, rank_batches
from trainflow.tasks.train.distributed import DistContext, distributed, wrap_ddp
from trainflow.tasks.train.loop import Trainer, make_optimizer, train_epoch
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.precision import resolve_precision
from trainflow.tasks.train.step_times import StepTimes, gather_rows
from trainflow.tasks.train.stragglers import StragglerWatch

PAIRS = 8
SAMPLES = 6400  # 50 steps an epoch per rank at batch 64: one window of 50
WINDOWS = (50, 5)
GATHERS = 200
BLOCKS = 40


def _epoch(trainer: Trainer, data: Split, cfg: TrainConfig, epoch: int, step: int) -> float:
    """Seconds per step of one epoch of this rank."""
    batches = rank_batches(data, cfg.batch_size, cfg.seed, epoch, trainer.dist.rank, 2)
    start = time.perf_counter()
    train_epoch(trainer, data, batches, step)
    return (time.perf_counter() - start) / len(batches)


def _rank(rank: int, port: int, out: Any) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ |= {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    torch.set_num_threads(1)
    cfg = TrainConfig(device="cpu")
    spec = image_classification((1, 28, 28), 10)
    with distributed("cpu") as ctx:
        torch.manual_seed(0)
        model = build_model(cfg, spec)
        policy = resolve_precision(cfg.precision, ctx.device)
        optimizer = make_optimizer(cfg, model)
        ddp = wrap_ddp(model, ctx)
        objective = Classification(spec)
        plain = Trainer(ddp, optimizer, policy.make_scaler(), policy, ctx, objective, cfg.lr, 10**9)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, 1, 28, 28, generator=gen)
        data = Split(x, torch.randint(0, 10, (SAMPLES,), generator=gen))
        said: list[str] = []
        results: dict[str, Any] = {}
        epoch = 0
        _epoch(plain, data, cfg, 0, 0)  # warm-up
        for window in WINDOWS:
            off, on = [], []
            for _ in range(PAIRS):
                epoch += 1
                off.append(_epoch(plain, data, cfg, epoch, 0))
                watch = StragglerWatch(0.2, 3, window, ["n0", "n1"], None, said.append)
                timer = StepTimes(ddp, ctx, window, watch)
                epoch += 1
                on.append(_epoch(replace(plain, timer=timer), data, cfg, epoch, 0))
                timer.close()
            results[f"window_{window}"] = {"off_s": off, "on_s": on}
        gathers = []
        for _ in range(GATHERS):
            start = time.perf_counter()
            gather_rows([0.0, 0.0, 0.0, 1.0], ctx)
            gathers.append(time.perf_counter() - start)
        results["gather_s"] = statistics.median(gathers)
        results["warnings"] = said
        if rank == 0:
            out.put(results)
        dist.barrier()


def _own_cost(port: int, out: Any) -> None:
    """Median step time of a DDP group of one with and without the timer (BLOCKS pairs)."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = TrainConfig(device="cpu")
    spec = image_classification((1, 28, 28), 10)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    torch.manual_seed(0)
    model = build_model(cfg, spec)
    policy = resolve_precision(cfg.precision, ctx.device)
    optimizer = make_optimizer(cfg, model)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, static_graph=True)
    objective = Classification(spec)
    plain = Trainer(ddp, optimizer, policy.make_scaler(), policy, ctx, objective, cfg.lr, 10**9)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16 * cfg.batch_size, 1, 28, 28, generator=gen)
    data = Split(x, torch.randint(0, 10, (len(x),), generator=gen))
    batches = rank_batches(data, cfg.batch_size, cfg.seed, 1, 0, 1)
    off, on = [], []
    train_epoch(plain, data, batches, 0)  # warm-up
    for _ in range(BLOCKS):
        start = time.perf_counter()
        train_epoch(plain, data, batches, 0)
        off.append((time.perf_counter() - start) / len(batches))
        timer = StepTimes(ddp, ctx, 50, None)
        start = time.perf_counter()
        train_epoch(replace(plain, timer=timer), data, batches, 0)
        on.append((time.perf_counter() - start) / len(batches))
        timer.close()
    out.put({"off_s": off, "on_s": on})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Measure the step timer's and the window gathers' cost on 2 gloo ranks."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    measured: dict[str, Any] = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    one = context.Process(target=_own_cost, args=(_free_port(), queue))
    one.start()
    own: dict[str, list[float]] = queue.get(timeout=600)
    one.join(timeout=60)
    result: dict[str, Any] = {"pairs": PAIRS, "ranks": 2, "steps_per_epoch": SAMPLES // 128}
    rows = []
    for window in WINDOWS:
        m = measured[f"window_{window}"]
        off, on = statistics.median(m["off_s"]), statistics.median(m["on_s"])
        pairs = [b / a for a, b in zip(m["off_s"], m["on_s"], strict=True)]
        ratio = statistics.median(pairs)
        result[f"window_{window}"] = {
            "ratio_median_of_pairs": ratio,
            "step_s_off": off,
            "step_s_on": on,
            **m,
        }
        rows.append((f"step time timed/plain (window {window} steps)", f"{ratio:.3f}x", "<= 1.01"))
        ms = f"{off * 1e3:.2f}/{on * 1e3:.2f}"
        rows.append((f"  step ms plain / timed (window {window})", ms, ""))
    off, on = statistics.median(own["off_s"]), statistics.median(own["on_s"])
    result["own_cost"] = {"step_s_off": off, "step_s_on": on, "blocks": BLOCKS, **own}
    rows.append(("timer's own cost a step (1 process)", f"{(on - off) * 1e6:.1f} us", ""))
    rows.append(("  step ms plain / timed (1 process)", f"{off * 1e3:.3f}/{on * 1e3:.3f}", ""))
    gather_ms = measured["gather_s"] * 1e3
    result["gather_s"] = measured["gather_s"]
    result["warnings"] = measured["warnings"]
    rows.append(("one window all-gather (4 floats, gloo)", f"{gather_ms:.3f} ms", ""))
    return "P10 straggler detection cost (2 gloo ranks, median step time)", rows, result
