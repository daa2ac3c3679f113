"""P10: creating a new local MLflow store, MLflow's own way against trainflow's (a copy of this
machine's migrated template; the first store, which makes the template, without a disk sync per
schema migration: tasks/tracking/new_store.py), on a quiet disk and while another process
writes 6 GB to the same disk (as a dataset being preprocessed beside it does).

Both ways alternate in one process, 3 pairs per condition; medians and their ratio; the first
store (no template yet) is timed once, on the quiet disk. Goal: not slower on a quiet disk;
the fsyncs were the cost on a busy one.
"""

import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from trainflow.tasks.tracking.new_store import create_local_store

PAIRS = 3
WRITER_MB = 6000


def _create(kind: str, scratch: Path) -> float:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder = Path(tempfile.mkdtemp(dir=scratch))
    uri = f"sqlite:///{folder}/mlflow.db"
    start = time.perf_counter()
    if kind == "mlflow":
        SqlAlchemyStore(uri, (folder / "mlartifacts").as_uri()).engine.dispose()
    else:
        create_local_store(uri, folder / "mlartifacts")
    return time.perf_counter() - start


def _pairs(scratch: Path) -> dict[str, float]:
    times: dict[str, list[float]] = {"mlflow": [], "trainflow": []}
    for _ in range(PAIRS):
        for kind in times:
            times[kind].append(_create(kind, scratch))
    return {kind: statistics.median(values) for kind, values in times.items()}


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """The benchmark: (title, table rows, result to save)."""
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    scratch = Path(tempfile.mkdtemp(prefix="trainflow-p10-", dir="/var/tmp"))
    cache = os.environ.get("TRAINFLOW_CACHE")
    os.environ["TRAINFLOW_CACHE"] = str(scratch / "cache")  # no template yet
    try:
        _create("mlflow", scratch)  # imports and first-use costs out of the timings
        first = _create("trainflow", scratch)  # makes the template
        quiet = _pairs(scratch)
        big = scratch / "writer.bin"
        writer = subprocess.Popen(
            ["dd", "if=/dev/zero", f"of={big}", "bs=1M", f"count={WRITER_MB}", "conv=fsync"],
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(1)
            busy = _pairs(scratch)
        finally:
            writer.kill()
            writer.wait()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if cache is None:
            os.environ.pop("TRAINFLOW_CACHE", None)
        else:
            os.environ["TRAINFLOW_CACHE"] = cache
    load = os.getloadavg()[0]
    q, b = quiet, busy
    rows = [
        ("quiet disk: MLflow / trainflow (s)", f"{q['mlflow']:.2f} / {q['trainflow']:.2f}", ""),
        ("quiet disk: ratio", f"{q['mlflow'] / q['trainflow']:.1f}", ">= 1"),
        ("disk busy: MLflow / trainflow (s)", f"{b['mlflow']:.2f} / {b['trainflow']:.2f}", ""),
        ("disk busy: ratio", f"{b['mlflow'] / b['trainflow']:.1f}", "report"),
        ("quiet disk: the machine's first store (makes the template, s)", f"{first:.2f}", ""),
        ("load average (1 min)", f"{load:.1f}", ""),
    ]
    result = {"quiet_s": quiet, "busy_s": busy, "first_s": first, "load": load, "pairs": PAIRS}
    return "P10 new local MLflow store (medians of 3 pairs)", rows, result
