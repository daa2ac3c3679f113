"""Rank 0's console lines from several threads stay whole (trainflow.console)."""

import io
import sys
import threading
from pathlib import Path

import pytest

from trainflow.console import say

NAMES = ("recorder", "training")


def _lines(name: str) -> None:
    for i in range(3000):
        say(f"{name} {i:05d}")


def test_lines_of_two_threads_never_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An unbuffered stdout (PYTHONUNBUFFERED, as job logs often are) writes each call at once:
    # print()'s text and newline are two writes, and another thread's line lands between
    # them (hundreds of merged lines in this set-up); say's one write never splits.
    path = tmp_path / "out.txt"
    with io.FileIO(path, "w") as raw:
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, write_through=True))
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch as often as they can
        try:
            threads = [threading.Thread(target=_lines, args=(n,)) for n in NAMES]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            sys.setswitchinterval(interval)
            sys.stdout.flush()
    lines = path.read_text().splitlines()
    assert len(lines) == 6000
    assert sorted(lines) == sorted(f"{n} {i:05d}" for n in NAMES for i in range(3000))
