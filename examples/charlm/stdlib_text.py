"""A user's data source for the character language-model example (a trainflow source plug-in).

The text: the Python standard library's own source files (`Lib/*.py` of the interpreter that
runs trainflow), real code written by many people over 30 years, on every machine with Python.
Each file is a part; a worker cuts it into windows of `context` bytes: the input is a window,
the target the same window shifted by one byte (next-character prediction at every position).
The vocabulary is the 256 byte values.
"""

import hashlib
import sysconfig
from pathlib import Path
from typing import ClassVar

import numpy as np


class StdlibText:
    """The first `max_files` (sorted by name) of the standard library's top-level .py files."""

    classes: ClassVar[list[str]] = [f"{b:02x}" for b in range(256)]
    """The vocabulary: one token per byte value (shown as hex)."""

    def __init__(self, context: int = 64, max_files: int = 40, min_bytes: int = 2048) -> None:
        self.context = context
        self.max_files = max_files
        self.min_bytes = min_bytes
        self.folder = Path(sysconfig.get_paths()["stdlib"])

    def parts(self) -> list[str]:
        """File paths: the client lists names and sizes, it reads no text."""
        files = sorted(p for p in self.folder.glob("*.py") if p.stat().st_size >= self.min_bytes)
        return [str(p) for p in files[: self.max_files]]

    def fingerprint(self, part: str) -> str:
        """The file's bytes and the window length."""
        digest = hashlib.sha256(f"{self.context}\n".encode())
        digest.update(Path(part).read_bytes())
        return digest.hexdigest()

    def read(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        """(windows (n, context) int64, next bytes (n, context) int64) of one file."""
        data = np.frombuffer(Path(part).read_bytes(), dtype=np.uint8).astype(np.int64)
        n = (len(data) - 1) // self.context
        x = data[: n * self.context].reshape(n, self.context)
        y = data[1 : n * self.context + 1].reshape(n, self.context)
        return x, y
