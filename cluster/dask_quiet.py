"""Dask workers keep the teardown race off the user's console (tracebacks only with --debug).

When a stage fails, the flow closes its dask cluster at once; a worker whose heartbeat was in
flight while the scheduler closed logs `Failed to communicate with scheduler during heartbeat.`
with a 25-line traceback (distributed.worker.Worker.heartbeat, `logger.exception`) straight to
the stderr the user reads, after the one error line that says what went wrong (seen in a
fresh-clone run of the suite: the error-output test failed on it). A scheduler really lost
mid-work is reported by the client side (the flow names it); the worker's record adds nothing.
"""

import logging
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

from trainflow.errors import debug_enabled

_HEARTBEAT_LOST = "Failed to communicate with scheduler during heartbeat"


class _HeartbeatLost(logging.Filter):
    """Drops the worker's lost-heartbeat record (its traceback with it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for the lost-heartbeat record."""
        return not record.getMessage().startswith(_HEARTBEAT_LOST)


class QuietHeartbeat(WorkerPlugin):
    """Installs _HeartbeatLost on each worker's `distributed.worker` logger, unless the flow
    runs with --debug (TRAINFLOW_DEBUG, read in the flow: workers of an existing scheduler do
    not share its environment)."""

    name = "trainflow-quiet-heartbeat"

    def __init__(self, debug: bool) -> None:
        self.debug = debug

    def setup(self, worker: Any) -> None:
        """Runs in the worker process."""
        logger = logging.getLogger("distributed.worker")
        if not self.debug and not any(isinstance(f, _HeartbeatLost) for f in logger.filters):
            logger.addFilter(_HeartbeatLost())


def register_quiet_heartbeat(client: Client) -> None:
    """Every worker of `client`'s cluster (present and future) drops the lost-heartbeat
    record unless the user asked for tracebacks."""
    client.register_plugin(QuietHeartbeat(debug_enabled()))
