"""Metric points sent to MLflow by a background thread, so that training never waits on it.

The flow's journal relay (tasks.tracking.relay) hands points to a bounded in-memory buffer
(``put``) and asks for them to be sent (``wake``); one sender thread sends them in order,
oldest first, in ``log_batch`` calls of at most 1000 points. Each call is made once, with a
short timeout and no retries of MLflow's own (its defaults retry a dead server for ~4 minutes
per call); the sender retries by itself, backing off up to ``MAX_BACKOFF_S``, for as long as
the relay runs.

While the server cannot be reached, one line says so (and one more when it is back); points
stay buffered in order. A retried batch carries the same timestamps, and MLflow's SQL store
ignores a metric equal in key, value, step and timestamp to one it holds, so a batch that
reached the server although its reply did not is not stored twice.

``close`` gives the server a bounded time to take what is left and returns the points it
never took (they stay in the job's journal, tasks.tracking.relay).
"""

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from urllib.parse import urlparse

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

MAX_BATCH = 1000
"""log_batch accepts at most 1000 metrics per call."""
MAX_POINTS = 100_000
"""Buffer bound (~20 MB): further points are dropped and counted, never block training."""
SEND_TIMEOUT_S = 10
"""Connect and read timeout of one log_batch call."""
MAX_BACKOFF_S = 10.0
"""Longest pause between two attempts while the server is unreachable."""
GIVE_UP_S = 5.0
"""close() waits at most this long for a server that is unreachable when it is called."""
_LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"


class MetricSender:
    """The bounded buffer and its sender thread (see the module docstring)."""

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        say: Callable[[str], None] = print,
        max_points: int = MAX_POINTS,
    ) -> None:
        self._uri, self._run_id, self._say = tracking_uri, run_id, say
        self._send_batch = _batch_sender(tracking_uri, run_id)
        self._max_points = max_points
        self._buffer: deque[Metric] = deque()
        self._cond = threading.Condition()
        self._wanted = False  # wake() called: send what is buffered
        self._closing = False
        self._down_since: float | None = None  # set while the server is unreachable
        self._next_try = 0.0  # monotonic time of the next attempt while backing off
        self.sent = 0
        """Points the server took."""
        self.dropped = 0
        """Points refused for good (buffer full, or the server rejected them as invalid)."""
        self._thread = threading.Thread(target=self._run, name="mlflow-sender", daemon=True)
        self._thread.start()

    @property
    def unreachable(self) -> bool:
        """Whether the last attempt failed to reach the server."""
        return self._down_since is not None

    def put(self, metrics: list[Metric]) -> None:
        """Buffer points (in order); never blocks on the network."""
        with self._cond:
            room = max(self._max_points - len(self._buffer), 0)
            if room < len(metrics) and self.dropped == 0:
                self._say(
                    f"warning: MLflow metric buffer full ({self._max_points} points not yet "
                    f"sent to {self._uri}): newer points are dropped"
                )
            self.dropped += max(len(metrics) - room, 0)
            self._buffer.extend(metrics[:room])

    def wake(self) -> None:
        """Ask the thread to send everything buffered (returns at once)."""
        with self._cond:
            self._wanted = True
            self._cond.notify()

    def close(self, drain_s: float) -> list[Metric]:
        """Keep sending what is left for up to `drain_s` seconds (GIVE_UP_S while the server
        stays unreachable), stop the thread and return the points not sent, oldest first."""
        start = time.monotonic()
        with self._cond:
            self._wanted, self._next_try = True, 0.0  # one more attempt now
            self._cond.notify()
            while self._buffer and self._thread.is_alive():
                waited = time.monotonic() - start
                if waited >= drain_s or (self.unreachable and waited >= min(GIVE_UP_S, drain_s)):
                    break
                self._cond.wait(timeout=0.25)
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=SEND_TIMEOUT_S + 5)
        with self._cond:
            left = list(self._buffer)
            self._buffer.clear()
        return left

    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._cond:
                while not self._closing:
                    pending = self._wanted and bool(self._buffer)
                    wait = self._next_try - time.monotonic()
                    if pending and wait <= 0:
                        break
                    self._cond.wait(timeout=wait if pending else None)
                if self._closing:
                    return
                batch = [self._buffer[i] for i in range(min(MAX_BATCH, len(self._buffer)))]
            outcome = self._attempt(batch)
            with self._cond:
                if outcome != "retry":
                    for _ in batch:
                        self._buffer.popleft()
                    self._wanted = bool(self._buffer)
                if outcome == "rejected":
                    self.dropped += len(batch)
                self._cond.notify_all()
                if outcome == "retry":
                    self._next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                else:
                    self._next_try, backoff = 0.0, 0.5

    def _attempt(self, batch: list[Metric]) -> str:
        """'sent', 'rejected' (dropped: retrying cannot help) or 'retry'."""
        try:
            self._send_batch(batch)
        except Exception as exc:
            if _permanent(exc):
                self._say(f"warning: MLflow rejected {len(batch)} metric points: {exc}")
                return "rejected"
            if self._down_since is None:
                self._down_since = time.time()
                self._say(
                    f"warning: MLflow tracking server {self._uri} unreachable "
                    f"({_short(exc)}): metric points are buffered and sent when it is back; "
                    "training does not wait"
                )
            return "retry"
        if self._down_since is not None:
            since = datetime.fromtimestamp(self._down_since).strftime("%H:%M:%S")
            self._down_since = None
            with self._cond:
                queued = len(self._buffer)
            self._say(
                f"MLflow tracking server {self._uri} reachable again (unreachable since "
                f"{since}): sending {queued} buffered metric points"
            )
        self.sent += len(batch)
        return "sent"


def _batch_sender(tracking_uri: str, run_id: str) -> Callable[[list[Metric]], None]:
    """A function sending one batch: over HTTP with one short attempt, else via the client."""
    if urlparse(tracking_uri).scheme not in ("http", "https"):
        client = MlflowClient(tracking_uri)

        def log_batch(batch: list[Metric]) -> None:
            client.log_batch(run_id, metrics=batch)

        return log_batch
    from mlflow.protos.service_pb2 import LogBatch
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.proto_json_utils import message_to_json
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    def send(batch: list[Metric]) -> None:
        body = message_to_json(LogBatch(run_id=run_id, metrics=[m.to_proto() for m in batch]))
        response = http_request(
            # What MLflow's REST store sends for an http(s) URI: auth, token, TLS settings.
            get_default_host_creds(tracking_uri),
            _LOG_BATCH,
            "POST",
            max_retries=0,
            timeout=SEND_TIMEOUT_S,
            json=json.loads(body),
        )
        verify_rest_response(response, _LOG_BATCH)

    return send


def _permanent(exc: Exception) -> bool:
    """An answer of the server that a retry cannot change (bad request, unknown run...)."""
    if not isinstance(exc, MlflowException):
        return False
    status = exc.get_http_status_code()
    return 400 <= status < 500 and status != 429


def _short(exc: Exception) -> str:
    """Why a send failed, in a few words."""
    text = str(exc)
    if "Connection refused" in text:
        return "connection refused"
    if "timed out" in text or "timeout" in text.lower():
        return f"no answer within {SEND_TIMEOUT_S} s"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:160]
