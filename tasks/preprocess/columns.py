"""Columns of an Arrow table as trainflow's (inputs, targets): shared by the parquet and
hf_dataset sources.

Three layouts, chosen by the source's arguments:
- numeric: `inputs` names numeric columns (stacked into (n, F) float32 features) or one column
  of fixed-length numeric lists ((n, D)); `target` a numeric column (integers: classes,
  floats: regression values).
- text: `inputs` names one string column and `tokenizer` a tokenizer folder; each part's
  documents become token windows of `context` ids packed for next-token prediction
  (tasks.preprocess.tokenize), the targets the windows shifted by one: no `target` column.

The schema is checked on the flow's host (footers only, no data read), so a missing column or a
column of the wrong type is one line before any job; a part's nulls are found by the worker
that reads it.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trainflow.errors import DataError
from trainflow.tasks.preprocess.tokenize import TokenizerInfo, pack, tokenizer_info

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True)
class ColumnSpec:
    """Which columns a table source reads and how it turns them into arrays."""

    inputs: tuple[str, ...]
    target: str | None
    tokenizer: TokenizerInfo | None
    context: int

    @property
    def columns(self) -> list[str]:
        """The only columns read from the files."""
        return [*self.inputs, *([self.target] if self.target else [])]

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary (every id it can give), for the model's output width."""
        return self.tokenizer.vocab_size if self.tokenizer else None


def column_spec(
    inputs: str | list[str],
    target: str | None,
    tokenizer: str | None,
    context: int,
    eos_token: str | None,
    where: str,
) -> ColumnSpec:
    """The checked arguments of a table source (no data read); DataError naming the argument."""
    names = (inputs,) if isinstance(inputs, str) else tuple(inputs)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise DataError(
            f"{where}: source_args.inputs={inputs!r}: name the input column (a string) or "
            "columns (a list of strings)"
        )
    if context < 1:
        raise DataError(f"{where}: source_args.context={context}: use a window of >= 1 tokens")
    if tokenizer is None:
        if target is None:
            raise DataError(
                f"{where}: no source_args.target: name the target column (numeric inputs), or "
                "give source_args.tokenizer (a folder) to model the text of an input column"
            )
        return ColumnSpec(names, target, None, context)
    if len(names) != 1 or target is not None:
        raise DataError(
            f"{where}: with a tokenizer, source_args.inputs names one text column and no "
            "target (the targets are the next tokens): drop source_args.target"
        )
    return ColumnSpec(names, None, tokenizer_info(tokenizer, eos_token, where), context)


def check_schema(schema: "pa.Schema", spec: ColumnSpec, where: str) -> None:
    """DataError naming the column for one that is missing or of a type `spec` cannot use."""
    import pyarrow as pa

    for name in spec.columns:
        if name not in schema.names:
            key = "target" if name == spec.target else "inputs"
            raise DataError(
                f"{where}: no column {name!r} (it has {', '.join(schema.names[:20])}): fix "
                f"preprocess.source_args.{key}"
            )
    types = {name: schema.field(name).type for name in spec.columns}
    if spec.tokenizer is not None:
        (name,) = spec.inputs
        if not (pa.types.is_string(types[name]) or pa.types.is_large_string(types[name])):
            raise DataError(
                f"{where}: column {name!r} is {types[name]}, not text: a tokenizer reads a "
                "string column"
            )
        return
    vector = len(spec.inputs) == 1 and _is_numeric_list(types[spec.inputs[0]])
    for name in () if vector else spec.inputs:
        _require_numeric(name, types[name], where, "an input")
    assert spec.target is not None
    _require_numeric(spec.target, types[spec.target], where, "the target")


def _require_numeric(name: str, kind: "pa.DataType", where: str, what: str) -> None:
    import pyarrow as pa

    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return
    advice = ""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        advice = (
            ": store class labels as integers 0..k-1"
            if what == "the target"
            else ": to model text, give source_args.tokenizer (a folder)"
        )
    raise DataError(f"{where}: column {name!r} ({what}) is {kind}, not a number{advice}")


def _is_numeric_list(kind: "pa.DataType") -> bool:
    import pyarrow as pa

    lists = pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind)
    lists = lists or pa.types.is_large_list(kind)
    value = getattr(kind, "value_type", None)
    return (
        lists and value is not None and (pa.types.is_integer(value) or pa.types.is_floating(value))
    )


def table_arrays(table: "pa.Table", spec: ColumnSpec) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one part's table, read on a dask worker; DataError (which the
    caller prefixes with the part and the source) for nulls or too little text."""
    for name in spec.columns:
        nulls = table.column(name).null_count
        if nulls:
            raise DataError(f"column {name!r} has {nulls} empty (null) values: fill or drop them")
    if spec.tokenizer is not None:
        texts = table.column(spec.inputs[0]).to_pylist()
        return pack(texts, spec.tokenizer, spec.context)
    assert spec.target is not None
    return _features(table, spec.inputs), _target(table.column(spec.target))


def _features(table: "pa.Table", inputs: tuple[str, ...]) -> np.ndarray:
    """(n, F) float32 of numeric columns, or (n, D) of one column of numeric lists."""
    import pyarrow.compute as pc

    column = table.column(inputs[0])
    if len(inputs) == 1 and _is_numeric_list(column.type):
        lengths = np.asarray(pc.list_value_length(column))
        if len(lengths) and (lengths.min() != lengths.max()):
            raise DataError(
                f"the lists of column {inputs[0]!r} have {lengths.min()} to "
                f"{lengths.max()} values: every row's list must have the same length"
            )
        values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
        return values.astype(np.float32).reshape(len(lengths), -1)
    out = np.empty((table.num_rows, len(inputs)), np.float32)
    for i, name in enumerate(inputs):
        out[:, i] = table.column(name).to_numpy()
    return out


def _target(column: Any) -> np.ndarray:
    """int64 classes or float32 values."""
    values = column.to_numpy()
    return values.astype(np.int64 if np.issubdtype(values.dtype, np.integer) else np.float32)
