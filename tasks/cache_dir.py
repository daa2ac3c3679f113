"""The per-user cache folder of trainflow: what a machine can make once and reuse (a migrated
MLflow store template). Never needed: whatever is cached can be made again."""

import os
from pathlib import Path


def cache_root() -> Path:
    """$TRAINFLOW_CACHE, else $XDG_CACHE_HOME/trainflow, else ~/.cache/trainflow."""
    if os.environ.get("TRAINFLOW_CACHE"):
        return Path(os.environ["TRAINFLOW_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "trainflow"
