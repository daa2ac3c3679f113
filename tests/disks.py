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


def tmpfs_where_possible(folder: Path, size: str) -> Iterator[Path]:
    """`folder` as a tmpfs of `size` where one can be mounted (root with mount rights), else as
    a plain folder on the test's own disk: for tests whose subject is not the disk, where a
    tmpfs only makes fsync free."""
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
    mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
    try:
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)
