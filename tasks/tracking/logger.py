"""Rank-0 metric logging behind a small interface: the loop calls ``log(metrics, step)``.

MLflow calls are slow when made one per metric (1000 x log_metric over HTTP: ~12 s), so
MlflowLogger buffers and sends one ``log_batch`` per ``flush``.
"""

import time
from typing import Protocol

# log_batch accepts at most 1000 metrics per call.
_MAX_BATCH = 1000


class MetricLogger(Protocol):
    """What a training loop needs to record metrics."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics at a step (may be buffered)."""

    def flush(self) -> None:
        """Send everything buffered."""


class NullLogger:
    """Logs nothing: used on ranks other than 0 and when no run is given."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Drop the metrics."""

    def flush(self) -> None:
        """Nothing to send."""


class MlflowLogger:
    """Buffers metrics and sends them to one MLflow run in batches."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        # Imported here: mlflow costs ~1 s of start-up in every rank, and only rank 0 logs.
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri)
        self._run_id = run_id
        self._buffer: list[Metric] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics; nothing is sent until flush()."""
        ts = int(time.time() * 1000)
        self._buffer += [self._metric(k, float(v), ts, step) for k, v in metrics.items()]

    def flush(self) -> None:
        """Send the buffer in as few log_batch calls as the API allows."""
        while self._buffer:
            chunk, self._buffer = self._buffer[:_MAX_BATCH], self._buffer[_MAX_BATCH:]
            self._client.log_batch(self._run_id, metrics=chunk)


def make_logger(tracking_uri: str | None, run_id: str | None, rank: int) -> MetricLogger:
    """MlflowLogger on rank 0 when a run is given, else NullLogger."""
    if rank == 0 and tracking_uri and run_id:
        return MlflowLogger(tracking_uri, run_id)
    return NullLogger()
