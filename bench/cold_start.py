"""Cold start of a training rank: process start and job start to the first finished step,
with torch._dynamo imported on a background thread from the job's
first line (`tasks.train.warmup`, the default) and without (imported where first needed).

The tiny preset's data and train config on the demo's cluster layout (2 CPU ranks here, one
rank per GPU on GPU machines), 1 epoch, ROUNDS alternating runs of each variant; run with
`python -m bench cold_start` (not part of the default `make bench`).
"""

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainflow.tasks.train.job import TrainingJob, TrainJobSpec

ROUNDS = 3


def _process_start() -> float:
    """This process's start time (epoch seconds), from /proc."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime")
    )
    return boot + ticks / os.sysconf("SC_CLK_TCK")


class _Done:
    """Stands in for the prewarm thread when prewarming is off: nothing to join."""

    def join(self, timeout: float | None = None) -> None:
        """Return at once."""


class TimedJob(TrainingJob):
    """The training job, recording when its first optimizer step finished on each rank."""

    def __init__(self, spec: TrainJobSpec, prewarm: bool) -> None:
        super().__init__(spec)
        self.prewarm = prewarm

    def __call__(self) -> Any:
        called = time.time()
        marks: dict[str, float] = {}

        def first_step(*_: Any) -> None:
            marks.setdefault("first_step", time.time())

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(first_step)
        if not self.prewarm:
            import trainflow.tasks.train.job as job

            job.prewarm_rank = lambda: _Done()  # type: ignore[assignment,return-value]
        result = super().__call__()
        rank = int(os.environ.get("RANK", "0"))
        record = {"process_start": _process_start(), "call": called, **marks}
        (self.spec.out_dir / f"cold-{rank}.json").write_text(json.dumps(record))
        return result


def _dataset(root: Path) -> Any:
    from trainflow.cluster.config import DaskConfig
    from trainflow.cluster.dask import dask_client
    from trainflow.flows.config import build_config
    from trainflow.tasks.preprocess.run import run_preprocess

    cfg = build_config("tiny").preprocess
    with dask_client(DaskConfig(backend="cpu", n_workers=1)) as (client, backend):
        return run_preprocess(cfg, root, client, backend, "cold-start-bench")


def _one(dataset: Any, folder: Path, prewarm: bool) -> dict[str, float]:
    from trainflow.cluster.executor import make_executor
    from trainflow.cluster.jobs import wait_for_job
    from trainflow.flows.config import build_config

    cfg = build_config("tiny", ["train.epochs=1"])
    gpus = torch.cuda.device_count()
    update = {"ranks_per_node": gpus, "gpus_per_node": gpus} if gpus else {}
    cluster = cfg.cluster.model_copy(update=update)
    spec = TrainJobSpec(train=cfg.train, dataset=dataset, out_dir=folder, cpus_per_task=1)
    start = time.time()
    job = make_executor(cluster, folder / "jobs").submit(TimedJob(spec, prewarm))
    wait_for_job(job, lambda _: None)
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("cold-*.json"))]
    slowest = max(records, key=lambda r: r["first_step"])
    return {
        "submit_to_first_step_s": slowest["first_step"] - start,
        "job_start_to_first_step_s": max(r["first_step"] - r["call"] for r in records),
        "process_start_to_job_start_s": max(r["call"] - r["process_start"] for r in records),
    }


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """ROUNDS runs with the prewarm and without, interleaved; medians of each measure."""
    runs: dict[str, list[dict[str, float]]] = {"prewarm": [], "no_prewarm": []}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = _dataset(Path(tmp) / "data")
        for i in range(ROUNDS):
            for name in runs:
                folder = Path(tmp) / f"{name}-{i}"
                runs[name].append(_one(dataset, folder, prewarm=name == "prewarm"))
    medians = {
        name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
        for name, rs in runs.items()
    }
    rows = [
        (f"{k.removesuffix('_s').replace('_', ' ')} ({name})", f"{v:.2f} s", "")
        for name, m in medians.items()
        for k, v in m.items()
    ]
    return "cold start of a training rank (medians)", rows, {"medians": medians, "runs": runs}
