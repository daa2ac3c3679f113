"""Metric points that could not be sent to MLflow, kept on disk next to the checkpoints.

The training job writes them when it ends while the tracking server is unreachable; the next
attempt of the job (a requeue, a resume) sends them first, and the flow sends what is left
once the job is over, or stops with a clear error if the server is still gone.
"""

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

from mlflow.entities import Metric

from trainflow.tasks.errors import TrainflowError
from trainflow.tasks.tracking.sender import MetricSender

FILE_NAME = "unlogged_metrics.jsonl"
"""The backlog's file in a training run's out_dir."""
DELIVER_S = 20.0
"""How long the flow tries to send a finished job's backlog before it gives up."""


class TrackingUnavailable(TrainflowError):
    """The MLflow tracking server cannot be reached at a step that needs it."""


def backlog_path(out_dir: Path) -> Path:
    """Where a training run's unsent points are kept."""
    return out_dir / FILE_NAME


def save(path: Path, points: list[Metric]) -> None:
    """Write `points` (oldest first) to `path` atomically; remove the file when empty."""
    if not points:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        for m in points:
            f.write(json.dumps([m.key, _encode(m.value), m.timestamp, m.step]) + "\n")
    os.replace(tmp, path)


def load(path: Path) -> list[Metric]:
    """The points saved at `path` (none when there is no file)."""
    if not path.exists():
        return []
    points = []
    for line in path.read_text().splitlines():
        if line.strip():
            key, value, ts, step = json.loads(line)
            points.append(Metric(key, float(value), int(ts), int(step)))
    return points


def _encode(value: float) -> float | str:
    """JSON has no NaN or infinity: those are written as their float() spelling."""
    return value if math.isfinite(value) else str(value)


def deliver(out_dir: Path, tracking_uri: str, run_id: str, log: Callable[[str], None]) -> None:
    """Send the points a finished training job left in out_dir; TrackingUnavailable (with
    their count and where they are kept) when the server does not take them in DELIVER_S."""
    path = backlog_path(out_dir)
    points = load(path)
    if not points:
        return
    log(f"{len(points)} metric points of the training job were not logged yet: sending them")
    sender = MetricSender(tracking_uri, run_id, say=lambda line: None)  # the error says it all
    sender.put(points)
    sender.wake()
    left = sender.close(DELIVER_S)
    save(path, left)
    if left:
        raise TrackingUnavailable(
            f"the MLflow tracking server {tracking_uri} cannot be reached: {len(left)} metric "
            f"points of training run {run_id} were not logged (kept in {path}). Training "
            f"finished; its checkpoints are in {out_dir}. Start the server again and check "
            "tracking.tracking_uri"
        )
    log(f"sent the {len(points)} metric points left over by the training job")
