"""The lines a training job prints to its log: the per-epoch progress line and where the
data lives (kept out of job.py, which composes the job)."""

from trainflow.tasks.train.data import SplitData as Split
from trainflow.tasks.train.distributed import DistContext


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
