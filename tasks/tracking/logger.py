"""Rank-0 metric logging behind a small interface: the loop calls ``log(metrics, step)``.

Points are buffered and written to the job's journal once per flush (an epoch); the flow
process sends them to MLflow in ``log_batch`` calls (tasks.tracking.relay), so training never
waits on the tracking server and no rank imports MLflow.
"""

import threading
import time
from typing import Literal, Protocol

from trainflow.console import say
from trainflow.tasks.tracking.journal import Journal, Point

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


class JournalLogger:
    """Buffers metrics and writes them to rank 0's journal at each flush; the flow sends them
    to the MLflow run (tasks.tracking.journal, tasks.tracking.relay). A flush's record also
    names the step it reached (tasks.tracking.logged_through): a resumed attempt does not log
    those steps again. `log` never waits for a flush's write: the two share only the buffer.
    A journal that cannot be written (a full disk) is one warning; training goes on."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._buffer: list[Point] = []
        self._last_step = 0
        self._lock = threading.Lock()  # the buffer
        self._writing = threading.Lock()  # one flush at a time: records stay in step order
        self._warned = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics; nothing is written before flush()."""
        ts = int(time.time() * 1000)
        with self._lock:
            self._buffer.extend((k, float(v), ts, step) for k, v in metrics.items())
            self._last_step = max(self._last_step, step)

    def flush(self) -> None:
        """Write what is buffered to the journal, with the step it reaches (one write)."""
        with self._writing:
            with self._lock:
                points, self._buffer = self._buffer, []
                step = self._last_step
            try:
                self._journal.metrics(points, through=step)
            except OSError as exc:
                if not self._warned:
                    say(f"warning: metrics not recorded for MLflow: {exc}")
                    self._warned = True

    def close(self, drain_s: float = DRAIN_S) -> int:
        """Write what is left; return 0 (the flow sends the journal)."""
        self.flush()
        return 0


def make_logger(journal: Journal | None) -> MetricLogger:
    """JournalLogger on rank 0 of a job with a run (it has the journal), else NullLogger."""
    if journal is not None:
        return JournalLogger(journal)
    return NullLogger()


def log_run_params(journal: Journal | None, params: dict[str, str]) -> None:
    """Record params only the job learns where it runs (the precision picked, and why) for its
    run; the flow logs them (a requeued job that picked otherwise: MLflow keeps a param's first
    value, and the flow says so in a warning line). Never raises."""
    _record(journal, "params", params)


def tag_run(journal: Journal | None, tags: dict[str, str]) -> None:
    """Record tags for the job's run (the flow sets them); never raises."""
    _record(journal, "tags", tags)


def _record(
    journal: Journal | None, kind: Literal["params", "tags"], values: dict[str, str]
) -> None:
    if journal is None:
        return
    try:
        journal.values(kind, values)
    except OSError as exc:
        say(f"warning: {kind} {sorted(values)} not recorded: {exc}")
