"""`preprocess.source=arrays`: .npz files of inputs and targets of any shape, as a source plug-in.

A built-in that goes through the same seam as a user's source (tasks.preprocess.plugin_source):
registered under a short name, built from `preprocess.source_args`, one part per file. Each
file holds an `inputs` array (n, ...) and a `targets` array (n, ...) (names configurable).
"""

from pathlib import Path

import numpy as np

from trainflow.errors import DataError
from trainflow.tasks.hashing import sha256_file


class ArrayFiles:
    """The .npz file at `path`, or every .npz file of the folder `path` (sorted), one part each."""

    def __init__(self, path: str, inputs: str = "inputs", targets: str = "targets") -> None:
        self.path, self.inputs, self.targets = Path(path), inputs, targets

    def parts(self) -> list[str]:
        """The files, in name order."""
        if self.path.is_file():
            return [str(self.path)]
        if not self.path.is_dir():
            raise DataError(f"source 'arrays': path {str(self.path)!r} does not exist")
        files = sorted(str(p) for p in self.path.glob("*.npz"))
        if not files:
            raise DataError(f"source 'arrays': no .npz files in {str(self.path)!r}")
        return files

    def fingerprint(self, part: str) -> str:
        """The file's sha256: the cache follows the content, not the timestamps."""
        return sha256_file(Path(part))

    def read(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        """The file's inputs and targets (never unpickled)."""
        with np.load(part, allow_pickle=False) as data:
            missing = [k for k in (self.inputs, self.targets) if k not in data.files]
            if missing:
                raise DataError(
                    f"{part!r} lacks {missing}: it has {sorted(data.files)}; save it with "
                    f"numpy.savez(path, {self.inputs}=..., {self.targets}=...)"
                )
            return data[self.inputs], data[self.targets]
