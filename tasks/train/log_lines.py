"""The lines a training job prints to its log: where and how it trains, the per-epoch progress
line and where the data lives (kept out of job.py, which composes the job)."""

from trainflow.console import say
from trainflow.tasks.tracking.journal import Journal
from trainflow.tasks.tracking.logger import log_run_params
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import SplitData as Split
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.models import uses_cuda_graphs
from trainflow.tasks.train.precision import PrecisionPolicy


def progress_line(metrics: dict[str, float]) -> str:
    """`loss 0.1234 acc 0.9000 val_loss ... 1234 samples/s`: the objective's metrics."""
    short = {"accuracy": "acc", "token_accuracy": "tok_acc", "perplexity": "ppl"}
    parts = []
    for name, value in metrics.items():
        split, _, metric = name.partition("_")
        if split in ("train", "val") and "_" not in metric.removeprefix("token_"):
            label = short.get(metric, metric)
            parts.append(f"{label if split == 'train' else 'val_' + label} {value:.4f}")
    return " ".join(parts) + f" {metrics['samples_per_s']:.0f} samples/s"


def memory_of(data: Split, dist: DistContext) -> str:
    """Where the training data lives, for the start-up line."""
    if not data.on_host:
        return f"{dist.device} memory"
    return "pinned-prefetch host memory" if dist.device.type == "cuda" else "host memory"


def announce(
    cfg: TrainConfig,
    dist: DistContext,
    policy: PrecisionPolicy,
    nhwc: bool,
    data: Split,
    journal: Journal | None,
) -> None:
    """Print where and how this run trains (rank 0's first log lines); the precision
    picked, and why, also go to the train run's params."""
    graphs = uses_cuda_graphs(cfg, dist.device)
    say(f"precision {policy.name}: {policy.reason}")
    params = {"precision.used": policy.name, "precision.reason": policy.reason}
    log_run_params(journal, params)
    say(
        f"training {cfg.model} on {dist.world_size} rank(s): device {dist.device}, "
        f"backend {dist.backend}, precision {policy.name}, channels_last "
        f"{'on' if nhwc else 'off'}, compile {'on' if cfg.compile or graphs else 'off'}, "
        f"cuda_graphs {'on' if graphs else 'off'}, data in {memory_of(data, dist)}, "
        f"strategy {cfg.strategy}" + (f", mesh {dist.mesh_text}" if dist.mesh_text else "")
    )
    if cfg.cuda_graphs and not graphs:
        say(
            f"warning: train.cuda_graphs=true is ignored on {dist.device} (CUDA graphs need "
            "a GPU); the last partial batch of each epoch is still dropped, as on a GPU"
        )
