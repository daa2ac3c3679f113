"""Rank 0's per-epoch side effects, written on a background thread while training goes on.

An epoch's record (metrics to MLflow, best.pt, the checkpoint, the progress line) costs rank 0
about 10 ms with an SQLite store (two fsynced files and a log_batch), up to ~50 ms on a busy
disk. Done inline, every rank waits that long at the next epoch's first all-reduce: with short
epochs it is the largest share of the training stage's overhead. The job instead copies the
state to host memory at the epoch's end (a consistent snapshot, cheap next to an epoch) and
hands the writing to one worker thread.

Records run one at a time and in order, and at most one is in flight: the next hand-off first
waits for the previous record, so a slow disk slows training down instead of queueing
snapshots. A record that failed fails the job at the next hand-off or at the end. Leaving the
context waits for the record in flight, also when the job is failing or being requeued, so
the last finished epoch's checkpoint is on disk before the process goes.

The metric logger the records write to is closed after the last record (``closing``): its
own thread sends points to MLflow, so that a tracking server that is down or slow never holds
up a record (tasks.tracking.sender); closing gives it a bounded time to send what is left.
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from trainflow.tasks.tracking.logger import MetricLogger

_DRAIN_ON_ERROR_S = 5.0
"""A failing job gives the tracking server this long to take its last points."""


class EpochRecorder:
    """One background writer for rank 0's epoch records (see the module docstring)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # started by the first record only
        self._pending: Future[None] | None = None
        self._loggers: list[MetricLogger] = []

    def closing(self, logger: MetricLogger) -> MetricLogger:
        """Close `logger` when leaving the context, after the last record; returns it."""
        self._loggers.append(logger)
        return logger

    def submit(self, record: Callable[[], None]) -> None:
        """Run `record` on the writer thread after the previous one; raise its error if any."""
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoch-record")
        self._pending = self._pool.submit(record)

    def flush_when_idle(self, logger: MetricLogger) -> None:
        """Flush `logger` on the writer thread unless a record is still being written (a
        checkpoint's save, which flushes it when it validated; else the next flush carries
        the points): the step never waits for the disk."""
        if self._pending is None or self._pending.done():
            self.submit(logger.flush)

    def wait(self) -> None:
        """Block until the record in flight is written; re-raise its exception."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> "EpochRecorder":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Wait for the record in flight and stop the thread. A record's own error is raised
        only when the body succeeded: it must not hide the error that is ending the job."""
        try:
            if exc is None:
                self.wait()
            elif self._pending is not None:
                self._pending.exception()  # waits; the body's exception goes on
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            for logger in self._loggers:
                if exc is None:
                    logger.close()
                else:
                    logger.close(_DRAIN_ON_ERROR_S)
