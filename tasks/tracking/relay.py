"""The flow's side of a training job's journal (tasks.tracking.journal): sends it to the run.

While the job runs, a thread reads the new whole records of every journal file of the job's
out_dir every ``POLL_S`` and hands metric points to a MetricSender (batched, in order, never
blocking; it says once when the server is unreachable and once when it is back, and retries
for as long as the job runs), params and tags to MLflow directly (retried at each poll while
the server is unreachable). When the job has ended, ``finish`` reads what is left and gives
the server ``DELIVER_S`` to take it; what it did not take is a TrackingUnavailable naming the
count and where the points are kept: the journal, which a resumed run sends again (MLflow's
SQL store keeps a point equal in key, value, step and timestamp once).
"""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainflow.errors import TrainflowError
from trainflow.tasks.tracking.journal import decode_points, journal_dir, read_records

POLL_S = 1.0
"""How often a running job's journal is read."""
DELIVER_S = 20.0
"""How long the end of a job waits for the server to take the points still unsent."""
FAILED_DELIVER_S = 5.0
"""The same after a job that failed or was cancelled (its error comes first)."""


class TrackingUnavailable(TrainflowError):
    """The MLflow tracking server cannot be reached at a step that needs it."""


class Relay:
    """Sends one job's journal (its out_dir's) to the MLflow run `run_id` (see the module
    docstring): `start` it when the job is submitted, `finish` it when the job has ended
    (`relaying` does both)."""

    def __init__(
        self, out_dir: Path, tracking_uri: str, run_id: str, say: Callable[[str], None]
    ) -> None:
        from mlflow.tracking import MlflowClient

        from trainflow.tasks.tracking.sender import MetricSender

        self.out_dir, self._uri, self._run_id, self._say = out_dir, tracking_uri, run_id, say
        self._client = MlflowClient(tracking_uri)
        self._sender = MetricSender(tracking_uri, run_id, say=say)
        self._offsets: dict[Path, int] = {}
        self._pending: list[tuple[str, dict[str, str]]] = []  # params and tags not yet set
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracking-relay", daemon=True)
        self.points = 0
        """Metric points read from the journal so far."""

    def start(self) -> None:
        """Start reading the journal every POLL_S."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the reading thread (finish reads what is left)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def pump(self) -> None:
        """Read the journal's new records and hand them on (returns without waiting)."""
        with self._lock:
            folder = journal_dir(self.out_dir)
            files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
            for path in files:
                records, self._offsets[path] = read_records(path, self._offsets.get(path, 0))
                for record in records:
                    self._take(record)
            self._set_pending()
        self._sender.wake()

    def finish(self, deliver_s: float = DELIVER_S) -> None:
        """Send what is left of the ended job's journal; TrackingUnavailable when the server
        does not take it within `deliver_s`."""
        self.stop()
        self.pump()
        left = self._sender.close(deliver_s)
        with self._lock:
            self._set_pending()
            unset = [name for name, _ in self._pending]
        if left or unset:
            what = f"{len(left)} metric points" + (f" and the {', '.join(unset)}" if unset else "")
            raise TrackingUnavailable(
                f"the MLflow tracking server {self._uri} cannot be reached: {what} of training "
                f"run {self._run_id} were not logged (kept in {journal_dir(self.out_dir)}, sent "
                f"when the run is resumed). Training finished; its checkpoints are in "
                f"{self.out_dir}. Start the server again and check tracking.tracking_uri"
            )

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.pump()
            except OSError as exc:  # the journal's folder gone or unreadable: said, retried
                self._say(f"warning: cannot read the training job's journal: {exc}")

    def _take(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        if "metrics" in record:
            points = decode_points(record["metrics"])
            self._sender.put([Metric(k, v, ts, step) for k, v, ts, step in points])
            self.points += len(points)
        for kind in ("params", "tags"):
            if kind in record:
                self._pending.append((kind, {str(k): str(v) for k, v in record[kind].items()}))

    def _set_pending(self) -> None:
        """Log the params and tags read so far, oldest first; stop at the first failure (the
        server unreachable) and keep it and the rest for the next call."""
        from trainflow.tasks.tracking.runs import log_params, set_tags

        while self._pending and not self._sender.unreachable:  # no ~10 s call into an outage
            kind, values = self._pending[0]
            try:
                if kind == "params":
                    log_params(self._client, self._run_id, values)
                else:
                    set_tags(self._client, self._run_id, values)
            except Exception as exc:
                if _unreachable(exc):
                    return
                name = type(exc).__name__
                self._say(f"warning: {kind} {sorted(values)} not logged: {name}: {exc}")
            self._pending.pop(0)


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the server could not be reached (as opposed to a refusal)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(w in text for w in ("connection", "timed out", "timeout", "max retries"))


@contextmanager
def relaying(
    out_dir: Path, tracking_uri: str | None, run_id: str | None, say: Callable[[str], None]
) -> Iterator[Relay | None]:
    """A started Relay for the block that waits for a job (None without a run), finished when
    the block ends: TrackingUnavailable after a job that ended well, one warning line after
    one that raised (its own error goes on, with what it logged before it failed sent)."""
    if not (tracking_uri and run_id):
        yield None
        return
    relay = Relay(out_dir, tracking_uri, run_id, say)
    relay.start()
    try:
        yield relay
    except BaseException:
        try:
            relay.finish(FAILED_DELIVER_S)
        except TrackingUnavailable as exc:
            say(f"warning: {exc}")
        raise
    relay.finish()
