"""P12: the cost of straggler detection: step time with per-step timing and the window
all-gathers over step time without (goal <= 1.01).

Two gloo ranks (one thread each, the 2-core CPU), the default config's model, precision and
batch on random MNIST-shaped data, DDP as the training job wraps it. Epochs with and without
the step timer (tasks.train.limits.step_times, its hooks on the model, judged on rank 0 by a
StragglerWatch as in a job) alternate in the same processes on the same model, so both see
the same machine noise: once with the default window (50 steps) and once with windows of 5
steps (ten times the all-gathers). Also measured: one all-gather of a window's four numbers
alone, which a window costs once.

On a loaded 2-core machine whole steps vary by more than 1% from one block to the next, so the
timer's own work is also measured part by part, in process CPU time over many repetitions:
its calls a step (four clock reads, the sums), and the autograd hook it adds to every
parameter (``register_multi_grad_hook``: one Python call per parameter per backward pass),
measured on a backward pass through HOOKED_PARAMS scalar parameters with and without it.
The timer's cost a step of a model is then: calls + parameters x hook cost + gather / window.
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

from trainflow.tasks.objectives.classification import Classification
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import Split, rank_batches
from trainflow.tasks.train.distributed import DistContext, distributed, wrap_ddp
from trainflow.tasks.train.limits.step_times import StepTimes, gather_rows
from trainflow.tasks.train.limits.stragglers import StragglerWatch
from trainflow.tasks.train.loop import Trainer, train_epoch
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.precision import resolve_precision

PAIRS = 8
SAMPLES = 6400  # 50 steps an epoch per rank at batch 64: one window of 50
WINDOWS = (50, 5)
GATHERS = 200
CALLS = 100_000
HOOKED_PARAMS = 200
ROUNDS = 15
BACKWARDS = 200


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


def _calls_cost() -> float:
    """CPU seconds of the timer's calls a step (data, step, forward hook, gradient hook, done)."""
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    timer = StepTimes(torch.nn.Linear(1, 1), ctx, 50, None)
    module = torch.nn.Linear(1, 1)
    start = time.process_time()
    for step in range(1, CALLS + 1):
        timer.data()
        timer.step()
        timer._forward_starts(module, ())
        timer._grads_done(())
        timer.done(step)
    return (time.process_time() - start) / CALLS


def _hook_cost() -> float:
    """CPU seconds the gradient hook adds to a backward pass, per parameter."""
    params = [torch.zeros((), requires_grad=True) for _ in range(HOOKED_PARAMS)]
    off: list[float] = []
    on: list[float] = []
    for _ in range(ROUNDS):
        for hooked, times in ((False, off), (True, on)):
            handle = None
            if hooked:
                handle = torch.autograd.graph.register_multi_grad_hook(
                    params, lambda grads: None, mode="all"
                )
            start = time.process_time()
            for _ in range(BACKWARDS):
                torch.stack(params).sum().backward()
            times.append((time.process_time() - start) / BACKWARDS)
            if handle is not None:
                handle.remove()
    return (statistics.median(on) - statistics.median(off)) / HOOKED_PARAMS


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
    torch.set_num_threads(1)
    calls, hook = _calls_cost(), _hook_cost()
    params = sum(
        1 for _ in build_model(TrainConfig(), image_classification((1, 28, 28), 10)).parameters()
    )
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
    gather_ms = measured["gather_s"] * 1e3
    plain_s = statistics.median(measured[f"window_{WINDOWS[0]}"]["off_s"])
    own_s = calls + params * hook + measured["gather_s"] / WINDOWS[0]
    result["parts"] = {
        "calls_cpu_s_per_step": calls,
        "hook_cpu_s_per_param": hook,
        "model_params": params,
        "cost_s_per_step": own_s,
        "share_of_plain_step": own_s / plain_s,
    }
    rows.append(("timer calls a step (CPU)", f"{calls * 1e6:.2f} us", ""))
    rows.append(("gradient hook a parameter (CPU)", f"{hook * 1e6:.2f} us", ""))
    rows.append(
        (
            f"cost a step, {params} params, window {WINDOWS[0]}",
            f"{own_s * 1e6:.1f} us = {100 * own_s / plain_s:.2f}%",
            "<= 1%",
        )
    )
    result["gather_s"] = measured["gather_s"]
    result["warnings"] = measured["warnings"]
    rows.append(("one window all-gather (4 floats, gloo)", f"{gather_ms:.3f} ms", ""))
    return "P12 straggler detection cost (2 gloo ranks, median step time)", rows, result
