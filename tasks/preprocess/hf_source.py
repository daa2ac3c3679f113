"""`preprocess.source=hf_dataset`: a Hugging Face dataset saved to disk, in row ranges.

The folder is what `datasets`' `save_to_disk` writes (Arrow files plus state.json); a
`DatasetDict` folder needs `split`. `datasets.load_from_disk` memory-maps the Arrow files, so the
flow's host reads only the schema and the row count, and each dask worker reads its row range's
named columns (the pages it touches), never the whole dataset. Columns become arrays as
tasks.preprocess.columns says. Needs the `hf` extra.
"""

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainflow.errors import ConfigError, DataError
from trainflow.tasks.hashing import sha256_folder
from trainflow.tasks.preprocess.columns import check_schema, column_spec, table_arrays
from trainflow.tasks.preprocess.tokenize import HF_EXTRA

if TYPE_CHECKING:
    import datasets

_VERSION = "hf-dataset-v1"
"""Changed whenever the same folder and arguments give other arrays (old caches stop matching)."""


class SavedDataset:
    """The dataset `save_to_disk` wrote to the folder `path` (its split `split` for a
    DatasetDict), one part per `rows_per_part` rows; columns as ParquetFiles takes them."""

    where = "source 'hf_dataset'"

    def __init__(
        self,
        path: str,
        inputs: str | list[str],
        target: str | None = None,
        tokenizer: str | None = None,
        context: int = 128,
        eos_token: str | None = None,
        split: str | None = None,
        rows_per_part: int = 20_000,
    ) -> None:
        self.path, self.split = Path(path), split
        if rows_per_part < 1:
            raise DataError(f"{self.where}: source_args.rows_per_part={rows_per_part}: use >= 1")
        self.rows_per_part = rows_per_part
        self.spec = column_spec(inputs, target, tokenizer, context, eos_token, self.where)
        self.num_classes = self.spec.vocab_size
        """The tokenizer's vocabulary (None for numeric data: the classes are 0..max)."""

    def parts(self) -> list[tuple[int, int]]:
        """(start, stop) row ranges; DataError for a missing column or one of the wrong type."""
        dataset = self._dataset()
        check_schema(dataset.features.arrow_schema, self.spec, f"{self.where} at {self._name}")
        step, n = self.rows_per_part, dataset.num_rows
        if n == 0:
            raise DataError(f"{self.where}: the dataset at {self._name} has no rows")
        return [(start, min(start + step, n)) for start in range(0, n, step)]

    @property
    def _name(self) -> str:
        return repr(str(self.path)) + (f" (split {self.split!r})" if self.split else "")

    def fingerprint(self, part: tuple[int, int]) -> str:
        """The folder's files (hashed once), the range and the tokenizer's identity."""
        tokenizer = self.spec.tokenizer.digest if self.spec.tokenizer else "-"
        return f"{_VERSION} {sha256_folder(self.path, recursive=True)} {part} {tokenizer}"

    def read(self, part: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The range's named columns as (inputs, targets), on a dask worker."""
        start, stop = part
        table = self._dataset().select_columns(self.spec.columns).with_format("arrow")[start:stop]
        return table_arrays(table, self.spec)

    def _dataset(self) -> "datasets.Dataset":
        """The memory-mapped dataset (loaded once per process); DataError when not one."""
        if not self.path.is_dir():
            raise DataError(
                f"{self.where}: path {str(self.path)!r} is not a folder: set "
                "preprocess.source_args.path to the folder save_to_disk wrote"
            )
        loaded = _load(str(self.path.resolve()), self.path.stat().st_mtime_ns)
        if isinstance(loaded, dict):  # a DatasetDict
            if self.split not in loaded:
                raise DataError(
                    f"{self.where}: {str(self.path)!r} holds the splits {sorted(loaded)}: set "
                    "preprocess.source_args.split to one of them"
                )
            return loaded[self.split]
        if self.split is not None:
            raise DataError(
                f"{self.where}: {str(self.path)!r} is one dataset, not a DatasetDict: drop "
                "preprocess.source_args.split"
            )
        return loaded


@functools.lru_cache(maxsize=4)
def _load(path: str, _mtime: int) -> "datasets.Dataset | datasets.DatasetDict":
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(f"source 'hf_dataset' needs `datasets`: {HF_EXTRA}") from exc
    try:
        return datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(
            f"source 'hf_dataset': {path!r} is not a dataset saved with save_to_disk: {exc}"
        ) from exc
