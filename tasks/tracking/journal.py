"""What a training job records for its MLflow run, written to files that the flow sends on.

Ranks never talk to MLflow. Importing it cost every rank 0 ~2.4 s of start-up on the way to
the first step (mlflow and its SQLAlchemy store, measured on a tiny job: the other ranks wait
for it at the first collective), and as much again on each other node's local rank 0 for the
system metrics; a compute node may not reach the tracking server at all; and a SQLite store
must not be written from several hosts over a shared filesystem. Instead rank 0 (metrics,
params, tags) and each node's local rank 0 (system metrics) append JSON lines to
``<out_dir>/tracking/<writer>.jsonl``, and the flow process that waits for the job sends them
(tasks.tracking.relay): within a second while the job runs, and what is left when it ends.

One record is one line, written with one write(2) on a file opened O_APPEND; a reader takes
whole lines only. The files stay after the job: a flow that could not send everything (the
server down) sends them again when the run is resumed (MLflow's SQL store keeps a point once).
"""

import json
import math
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

FOLDER = "tracking"
"""The journal's folder in a training run's out_dir."""

THROUGH = "through"
"""A metric record's key (its first) naming the step that every point up to is journaled."""

Point = tuple[str, float, int, int]
"""A metric point: key, value, timestamp (ms), step."""


def journal_dir(out_dir: Path) -> Path:
    """Where a training run's journal files are."""
    return out_dir / FOLDER


class Journal:
    """One writer's journal file (see the module docstring); safe to share between threads."""

    def __init__(self, out_dir: Path, writer: str) -> None:
        folder = journal_dir(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{writer}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def metrics(self, points: Iterable[Point], through: int | None = None) -> None:
        """Record metric points (oldest first); `through`: every point up to this step is
        in the journal with this record (tasks.tracking.logged_through reads it back), in
        the same write as the points."""
        rows = [[key, _encode(value), ts, step] for key, value, ts, step in points]
        if rows:
            mark = {} if through is None else {THROUGH: through}
            self._write({**mark, "metrics": rows})

    def values(self, kind: Literal["params", "tags"], values: dict[str, str]) -> None:
        """Record run params (MLflow keeps a param's first value) or tags."""
        self._write({kind: values})

    def close(self) -> None:
        """Close the file (further records are an error)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            written = os.write(self._fd, data)
        if written != len(data):  # a full disk: the line is cut, and readers skip it
            raise OSError(f"short write to {self.path} ({written} of {len(data)} bytes)")


@contextmanager
def opened(out_dir: Path | None, writer: str) -> Iterator[Journal | None]:
    """`writer`'s journal in `out_dir` for the block, closed after it; None without out_dir."""
    if out_dir is None:
        yield None
        return
    journal = Journal(out_dir, writer)
    try:
        yield journal
    finally:
        journal.close()


def read_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The whole records of `path` from byte `offset`, and the offset after the last one.
    A line that is not JSON (cut by a full disk) is skipped."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records, offset + end


def decode_points(rows: list[list[Any]]) -> list[Point]:
    """The points of a `metrics` record."""
    return [(str(k), float(v), int(ts), int(step)) for k, v, ts, step in rows]


def count_records(path: Path) -> int:
    """How many whole lines `path` holds (0 when it does not exist)."""
    try:
        with path.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def _encode(value: float) -> float | str:
    """JSON has no NaN or infinity: those are written as their float() spelling."""
    return value if math.isfinite(value) else str(value)
