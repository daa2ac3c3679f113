"""Dask workers import the user's code from the run's snapshot (cluster.snapshot) first."""

from pathlib import Path
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

from trainflow.cluster.snapshot import code_first


class SnapshotFirst(WorkerPlugin):
    """Each worker, including one restarted later, puts the snapshot first on its sys.path
    when it registers, before it deserialises any task that imports the user's modules."""

    name = "trainflow-code-snapshot"

    def __init__(self, paths: list[Path]) -> None:
        self.paths = [str(p) for p in paths]

    def setup(self, worker: Any) -> None:
        """Runs in the worker process."""
        code_first(Path(p) for p in self.paths)


def register_snapshot(client: Client, paths: list[Path]) -> None:
    """Make every worker of `client`'s cluster (present and future) import the user's code
    from the snapshot folders `paths` first (CodeSnapshot.paths; nothing when empty)."""
    if paths:
        client.register_plugin(SnapshotFirst(paths))
