"""The last metric step a training attempt's logger has written to the job's journal.

Each flush of rank 0's logger writes its points to the journal (tasks.tracking.journal) and
then this step; the next attempt must not log those epochs again. An attempt killed between
a checkpoint and its flush leaves its successor to re-log what the checkpoint holds beyond.
"""

import json
import os
from pathlib import Path

HANDED_NAME = "logged_through.json"
"""The file, in a training run's out_dir."""


def save_handed(out_dir: Path, step: int) -> None:
    """Record that every point up to `step` is in the journal (atomic write)."""
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
