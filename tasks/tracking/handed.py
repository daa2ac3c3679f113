"""The last metric step a training attempt's logger has dealt with: sent, or kept in the backlog.

A job that fails still closes its logger, which sends (or keeps on disk) every point it was
given; the next attempt must then not log those epochs again. A job killed outright never
writes this, and its successor re-logs what its checkpoint holds beyond the last flush.
Kept apart from the backlog so the ranks read it without importing MLflow.
"""

import json
import os
from pathlib import Path

HANDED_NAME = "logged_through.json"
"""The file, in a training run's out_dir."""


def save_handed(out_dir: Path, step: int) -> None:
    """Record that every point up to `step` was sent or is in the backlog (atomic write)."""
    path = out_dir / HANDED_NAME
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, path)


def handed_through(out_dir: Path) -> int:
    """The step save_handed recorded last; 0 when none was (or the job died without closing)."""
    try:
        return int(json.loads((out_dir / HANDED_NAME).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
