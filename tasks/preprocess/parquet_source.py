"""`preprocess.source=parquet`: Parquet files, one part per row group, through the plug-in seam.

Built on the flow's host from `preprocess.source_args` like a user's source
(tasks.preprocess.plugin_source): it lists the files' row groups from their footers and checks
the named columns' types there; each dask worker reads one row group at a time, and of it only
the named columns (pyarrow's `read_row_group(columns=...)`), so a dataset of any size streams
through bounded memory. Columns become arrays as tasks.preprocess.columns says.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainflow.errors import DataError
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.preprocess.columns import check_schema, column_spec, table_arrays

_VERSION = "parquet-v1"
"""Changed whenever the same files and arguments give other arrays (old caches stop matching)."""


@dataclass(frozen=True)
class RowGroup:
    """One part: a row group of a Parquet file."""

    file: str
    index: int

    def __str__(self) -> str:
        return f"{self.file} row group {self.index}"


class ParquetFiles:
    """The Parquet file `path`, or every *.parquet file under the folder `path` (sorted).

    `inputs`: the input column, or a list of numeric columns; `target`: the target column
    (numeric inputs); `tokenizer`: a folder holding tokenizer.json, to model the text of one
    string input column in windows of `context` tokens (`eos_token` overrides the end-of-text
    token that the folder's tokenizer_config.json names).
    """

    where = "source 'parquet'"

    def __init__(
        self,
        path: str,
        inputs: str | list[str],
        target: str | None = None,
        tokenizer: str | None = None,
        context: int = 128,
        eos_token: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.spec = column_spec(inputs, target, tokenizer, context, eos_token, self.where)
        self.num_classes = self.spec.vocab_size
        """The tokenizer's vocabulary (None for numeric data: the classes are 0..max)."""

    def parts(self) -> list[RowGroup]:
        """Every file's row groups, from the footers; DataError for a missing column or one
        of the wrong type (naming the file)."""
        import pyarrow.parquet as pq

        parts = []
        for file in self._files():
            where = f"{self.where}: {str(file)!r}"
            try:
                meta = pq.ParquetFile(file).metadata
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                raise DataError(f"{where} is not a readable Parquet file: {exc}") from exc
            check_schema(meta.schema.to_arrow_schema(), self.spec, where)
            parts += [RowGroup(str(file), i) for i in range(meta.num_row_groups)]
        if not parts:
            raise DataError(f"{self.where}: the files under {str(self.path)!r} hold no rows")
        return parts

    def _files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if not self.path.is_dir():
            raise DataError(
                f"{self.where}: path {str(self.path)!r} does not exist: set "
                "preprocess.source_args.path to a .parquet file or a folder of them"
            )
        files = sorted(self.path.rglob("*.parquet"))
        if not files:
            raise DataError(f"{self.where}: no .parquet files under {str(self.path)!r}")
        return files

    def fingerprint(self, part: RowGroup) -> str:
        """The file's sha256 (hashed once per file), the row group and the tokenizer's
        identity: the cache follows the content."""
        tokenizer = self.spec.tokenizer.digest if self.spec.tokenizer else "-"
        return f"{_VERSION} {_file_digest(part.file)} {part.index} {tokenizer}"

    def read(self, part: RowGroup) -> tuple[np.ndarray, np.ndarray]:
        """The row group's named columns as (inputs, targets), on a dask worker."""
        import pyarrow.parquet as pq

        table = pq.ParquetFile(part.file).read_row_group(part.index, columns=self.spec.columns)
        return table_arrays(table, self.spec)


def _file_digest(file: str) -> str:
    stat = Path(file).stat()
    return _digest(file, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _digest(file: str, _size: int, _mtime: int) -> str:
    """A file's sha256, once per process while its size and time are unchanged (each of its
    row groups asks)."""
    return sha256_file(Path(file))
