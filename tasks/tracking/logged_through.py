"""The last metric step a training attempt's logger has written to the job's journal.

Each flush of rank 0's logger writes its points to the journal (tasks.tracking.journal) with
the step they reach, in one write(2): the next attempt must not log those epochs again, and
a kill can never leave that step ahead of the points or behind them. An attempt killed between
a checkpoint and its flush leaves its successor to re-log what the checkpoint holds beyond.
"""

import json
from pathlib import Path

from trainflow.tasks.tracking.journal import THROUGH, journal_dir

WRITER = "rank0"
"""The journal the training job's logger writes (rank 0's)."""
_MARK = b'{"' + THROUGH.encode() + b'":'


def handed_through(out_dir: Path) -> int:
    """The step of the last whole metric record of rank 0's journal in `out_dir`; 0 when
    there is none."""
    try:
        data = (journal_dir(out_dir) / f"{WRITER}.jsonl").read_bytes()
    except OSError:
        return 0
    for line in reversed(data[: data.rfind(b"\n") + 1].splitlines()):
        if line.startswith(_MARK):
            try:
                return int(json.loads(line)[THROUGH])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a full disk: the one before holds
    return 0
