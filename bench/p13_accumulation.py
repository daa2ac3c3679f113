"""P13: gradient accumulation under DDP with one all-reduce a step (no_sync, as the job runs
it) against an all-reduce every micro-batch (goal: no slower).

Two gloo ranks (one thread each, the 2-core CPU), 2 micro-batches of 32 a step, random
MNIST-shaped data, the run's precision policy, through the job's own loop
(tasks.train.loop.train_epoch). Three DDP wrappers of the same model, their epochs
interleaved in the same processes so that machine noise hits them alike:

- no_sync: what the job does (tasks.train.distributed.wrap_ddp with accumulation 2:
  static_graph off, no_sync in all micro-batches but the last);
- every micro-batch, static_graph on: each backward all-reduces (DDP without no_sync, as
  the job ran before; static_graph then works);
- every micro-batch, static_graph off: the same without the static graph, which separates
  what no_sync saves from what the static graph saves.

"Every micro-batch" is DDP whose no_sync does nothing (a subclass), so the loop is the same
code. Also counted, by a DDP communication hook: all-reduce rounds per step of each; and
timed alone: one all-reduce of the model's gradients' size, what no_sync saves a step. On a
loaded 2-core machine epochs vary by more than the difference: the table shows the median of
the per-pair ratios and the ratio of the fastest epochs.
"""

import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from bench.ranks import free_port
from trainflow.tasks.objectives.classification import Classification
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import Split, accumulated_batches
from trainflow.tasks.train.distributed import distributed, wrap_ddp
from trainflow.tasks.train.loop import Trainer, train_epoch
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.models import place_model
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.precision import resolve_precision

MODELS: dict[str, dict[str, Any]] = {
    "reference_cnn": {},
    "resnet": {"width": 16},
    "mlp": {"hidden": 1024, "depth": 4},
}
"""The models measured and their arguments: gradients of 0.05, 0.7 and 15 MiB (the mlp's
steps are the shortest a MiB of gradients: the all-reduce's share is largest there)."""
ACCUMULATION = 2
BATCH = 32
STEPS = 8
"""Optimizer steps an epoch (each of ACCUMULATION micro-batches of BATCH per rank)."""
PAIRS = 7
"""Interleaved epochs of every setting."""
REDUCES = 20
"""All-reduces of a model's gradients' size timed alone (what no_sync saves a micro-batch)."""
SETTINGS = ("no_sync", "every_static", "every_dynamic")


class SyncsEveryMicroBatch(DistributedDataParallel):
    """DDP that all-reduces in every backward: its no_sync does nothing."""

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing: every micro-batch's backward all-reduces."""
        yield


def _counting(rounds: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if bucket.is_last():
        rounds[0] += 1
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group


def _wrapped(setting: str, model: torch.nn.Module, ctx: Any) -> torch.nn.Module:
    if setting == "no_sync":
        return wrap_ddp(model, ctx, accumulation=ACCUMULATION)
    return SyncsEveryMicroBatch(
        model, gradient_as_bucket_view=True, static_graph=setting == "every_static"
    )


def _rank(rank: int, port: int, out: Any) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ |= {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    torch.set_num_threads(1)
    spec = image_classification((1, 28, 28), 10)
    samples = 2 * ACCUMULATION * BATCH * STEPS
    gen = torch.Generator().manual_seed(0)
    data = Split(torch.randn(samples, 1, 28, 28, generator=gen), torch.randint(0, 10, (samples,)))
    results: dict[str, Any] = {}
    with distributed("cpu") as ctx:
        for name, args in MODELS.items():
            cfg = TrainConfig(model=name, model_args=args, device="cpu", batch_size=BATCH)
            policy = resolve_precision(cfg.precision, ctx.device)
            trainers, rounds = {}, {}
            for setting in SETTINGS:
                torch.manual_seed(0)
                model = place_model(build_model(cfg, spec), cfg, ctx.device)
                optimizer = make_optimizer(cfg, model)
                ddp = _wrapped(setting, model, ctx)
                rounds[setting] = [0]
                ddp.register_comm_hook(rounds[setting], _counting)  # type: ignore[operator]
                trainers[setting] = Trainer(
                    ddp, optimizer, policy.make_scaler(), policy, ctx, Classification(spec),
                    cfg.lr, 10**9, accumulation=ACCUMULATION,
                )  # fmt: skip
            times: dict[str, list[float]] = {s: [] for s in SETTINGS}
            for epoch in range(PAIRS + 1):  # the first: warm-up, not counted
                for setting in SETTINGS:
                    batches = accumulated_batches(data, BATCH, 0, epoch, rank, 2, ACCUMULATION)
                    rounds[setting][0] = 0
                    start = time.perf_counter()
                    train_epoch(trainers[setting], data, batches, 0)
                    if epoch:
                        times[setting].append((time.perf_counter() - start) / STEPS)
            flat = torch.zeros(sum(p.numel() for p in model.parameters()))
            reduces = []
            for _ in range(REDUCES):
                start = time.perf_counter()
                dist.all_reduce(flat)
                reduces.append(time.perf_counter() - start)
            results[name] = {
                "allreduce_s": statistics.median(reduces),
                "step_s": times,
                "rounds_per_step": {s: rounds[s][0] / STEPS for s in SETTINGS},
                "grad_mib": sum(p.numel() for p in model.parameters()) * 4 / 2**20,
            }
        if rank == 0:
            out.put(results)
        dist.barrier()


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Measure the three settings' step times on 2 gloo ranks, per model."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    measured: dict[str, Any] = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    result: dict[str, Any] = {
        "ranks": 2,
        "accumulation": ACCUMULATION,
        "micro_batch": BATCH,
        "steps_per_epoch": STEPS,
        "pairs": PAIRS,
    }
    rows = []
    for name, m in measured.items():
        step = {s: statistics.median(m["step_s"][s]) for s in SETTINGS}
        base = m["step_s"]["no_sync"]
        ratios = {
            s: statistics.median(b / a for a, b in zip(base, m["step_s"][s], strict=True))
            for s in SETTINGS[1:]
        }
        fastest = {s: min(m["step_s"][s]) for s in SETTINGS}  # least disturbed by the machine
        result[name] = {
            "step_s_median": step,
            "ratio_to_no_sync": ratios,
            "step_s_min": fastest,
            "ratio_of_min_to_no_sync": {s: fastest[s] / fastest["no_sync"] for s in SETTINGS[1:]},
            **m,
        }
        rounds = m["rounds_per_step"]
        rows.append((f"{name} ({m['grad_mib']:.2f} MiB of gradients)", "", ""))
        rows.append(
            (f"  step ms no_sync ({rounds['no_sync']:g} all-reduce/step)",
             f"{step['no_sync'] * 1e3:.1f}", "")
        )  # fmt: skip
        for s, label in (("every_static", "static_graph"), ("every_dynamic", "no static_graph")):
            rows.append(
                (f"  every micro-batch, {label} ({rounds[s]:g}/step) / no_sync",
                 f"{ratios[s]:.3f}x (fastest {fastest[s] / fastest['no_sync']:.3f}x)", ">= 1")
            )  # fmt: skip
        share = m["allreduce_s"] * (ACCUMULATION - 1) / step["no_sync"]
        rows.append(
            ("  one all-reduce of the gradients alone (saved a step)",
             f"{m['allreduce_s'] * 1e3:.2f} ms = {100 * share:.1f}%", "")
        )  # fmt: skip
    title = "P13 gradient accumulation under DDP (2 gloo ranks, 2 micro-batches a step)"
    return title, rows, result
