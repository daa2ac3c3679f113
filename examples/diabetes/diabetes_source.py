"""A user's data source for the diabetes regression example (a trainflow source plug-in).

The data: scikit-learn's bundled diabetes study (Efron et al., 2004): 442 patients, 10 baseline
measurements each (age, sex, body mass index, blood pressure, six blood serum values), and the
target, a measure of disease progression one year later. scikit-learn ships it as two gzipped
CSV files inside its package, so it is on every machine that has scikit-learn installed.

trainflow builds `DiabetesCSV(**preprocess.source_args)` on the flow's host, which lists the
parts (row ranges) and fingerprints them; each dask worker then reads one part into arrays.
"""

import gzip
import hashlib
from pathlib import Path

import numpy as np


def _data_folder() -> Path:
    import sklearn.datasets

    return Path(sklearn.datasets.__file__).parent / "data"


class DiabetesCSV:
    """Row ranges of scikit-learn's diabetes_data_raw.csv.gz and diabetes_target.csv.gz."""

    FEATURES = "diabetes_data_raw.csv.gz"
    TARGET = "diabetes_target.csv.gz"

    def __init__(self, rows_per_part: int = 128) -> None:
        self.rows_per_part = rows_per_part
        self.folder = _data_folder()

    def _rows(self) -> int:
        with gzip.open(self.folder / self.TARGET, "rt") as f:
            return sum(1 for line in f if line.strip())

    def parts(self) -> list[tuple[int, int]]:
        """(start, stop) row ranges: the client counts rows, it reads no features."""
        n = self._rows()
        return [(a, min(a + self.rows_per_part, n)) for a in range(0, n, self.rows_per_part)]

    def fingerprint(self, part: tuple[int, int]) -> str:
        """The two files' bytes and the range: the cache holds while neither changes."""
        digest = hashlib.sha256(repr(part).encode())
        for name in (self.FEATURES, self.TARGET):
            digest.update((self.folder / name).read_bytes())
        return digest.hexdigest()

    def read(self, part: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """(features (n, 10) float32, progression (n,) float32) of rows start..stop."""
        start, stop = part
        x = np.loadtxt(self.folder / self.FEATURES, dtype=np.float32)[start:stop]
        y = np.loadtxt(self.folder / self.TARGET, dtype=np.float32)[start:stop]
        return x, y
