"""Small real disks for full-disk tests: a tmpfs of a given size mounted under a test folder."""

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (mount's spelling: '64k', '3m') at `folder` for a fixture's
    lifetime; the test is skipped without root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
