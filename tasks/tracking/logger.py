"""Rank-0 metric logging behind a small interface: the loop calls ``log(metrics, step)``.

MLflow calls are slow when made one per metric (1000 x log_metric over HTTP: ~12 s), so
points are buffered and sent in ``log_batch`` calls, by a background thread that never makes
training wait on the tracking server (tasks.tracking.sender).
"""

import time
from pathlib import Path
from typing import Protocol

from trainflow.tasks.tracking.handed import save_handed

DRAIN_S = 30.0
"""How long the end of a job waits for the server to take the points still buffered."""


class MetricLogger(Protocol):
    """What a training loop needs to record metrics."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics at a step (may be buffered)."""

    def flush(self) -> None:
        """Have everything buffered sent (in the background: returns at once)."""

    def close(self, drain_s: float = DRAIN_S) -> int:
        """Send what is left within `drain_s`, keep the rest on disk; return its count."""


class NullLogger:
    """Logs nothing: used on ranks other than 0 and when no run is given."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Drop the metrics."""

    def flush(self) -> None:
        """Nothing to send."""

    def close(self, drain_s: float = DRAIN_S) -> int:
        """Nothing left."""
        return 0


class MlflowLogger:
    """Buffers metrics and has a MetricSender send them to one MLflow run in batches.

    With `out_dir`, points a previous attempt could not send (tasks.tracking.backlog) go
    first, and the points this one cannot send are kept there when it closes.
    """

    def __init__(self, tracking_uri: str, run_id: str, out_dir: Path | None = None) -> None:
        # Imported here: mlflow costs ~1 s of start-up in every rank, and only rank 0 logs.
        from mlflow.entities import Metric

        from trainflow.tasks.tracking import backlog
        from trainflow.tasks.tracking.sender import MetricSender

        self._metric, self._save = Metric, backlog.save
        self._uri = tracking_uri
        self._sender = MetricSender(tracking_uri, run_id, say=lambda line: print(line, flush=True))
        self._out_dir = out_dir
        self._backlog = backlog.backlog_path(out_dir) if out_dir else None
        self._last_step = 0
        if self._backlog is not None:
            self._sender.put(backlog.load(self._backlog))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics; nothing is sent before flush()."""
        ts = int(time.time() * 1000)
        self._sender.put([self._metric(k, float(v), ts, step) for k, v in metrics.items()])
        self._last_step = max(self._last_step, step)

    def flush(self) -> None:
        """Have the sender thread send the buffer (returns at once)."""
        self._sender.wake()

    def close(self, drain_s: float = DRAIN_S) -> int:
        """Send what is left within `drain_s`; keep the rest in out_dir; return its count."""
        left = self._sender.close(drain_s)
        if self._out_dir is not None and self._backlog is not None:
            self._save(self._backlog, left)
            # A resumed attempt must not log these steps again (tasks.train.job._relog).
            save_handed(self._out_dir, self._last_step)
        lost = len(left) + self._sender.dropped
        if lost:
            where = f"; kept in {self._backlog}" if self._backlog and left else ""
            print(
                f"warning: {lost} metric points were not logged to MLflow at {self._uri} "
                f"({self._sender.sent} were){where}",
                flush=True,
            )
        return lost


def make_logger(
    tracking_uri: str | None, run_id: str | None, rank: int, out_dir: Path | None = None
) -> MetricLogger:
    """MlflowLogger on rank 0 when a run is given, else NullLogger."""
    if rank == 0 and tracking_uri and run_id:
        return MlflowLogger(tracking_uri, run_id, out_dir)
    return NullLogger()


def log_run_params(tracking_uri: str | None, run_id: str | None, params: dict[str, str]) -> None:
    """Log params only the job learns where it runs (the precision picked, and why) on its
    run. Never raises: a requeued job that picked otherwise (MLflow keeps a param's first
    value) or an unreachable server is a warning line."""
    if not (tracking_uri and run_id):
        return
    try:
        from mlflow.tracking import MlflowClient

        from trainflow.tasks.tracking.runs import log_params

        log_params(MlflowClient(tracking_uri), run_id, params)
    except Exception as exc:
        said = (str(exc).splitlines() or [""])[0][:300]
        name = type(exc).__name__
        print(f"warning: params {sorted(params)} not logged: {name}: {said}", flush=True)
