"""Data-source plug-ins: `preprocess.source=package.module:Source` reads a user's own data.

A source is a small class (the `Source` protocol below). trainflow builds it on the flow's host
as `Source(**preprocess.source_args)`, asks it only to list its parts (files, row ranges: any
picklable value) and fingerprint each (for the cache), then sends it to the dask workers, where
each part is read by one worker into (inputs, targets) arrays and staged to a scratch file.
Everything after that is the built-in sources' path: validation, splitting, sharding, content
hash, caching, streaming to the ranks. A part that cannot be read, or whose arrays are
unusable, fails the stage with one line naming the part and the source.

Inputs and targets stay on the workers' disks (staged beside each other) until the
shard-writing tasks take their rows: the client gets each part's shapes, dtypes and id range,
and the targets themselves only when they are one class per sample (the split is stratified by
class, as the npz source's labels are). Token windows' targets, as large as the inputs, never
pass through the client.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from trainflow.errors import DataError
from trainflow.tasks import plugins
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.guarded import run_guarded
from trainflow.tasks.preprocess.raw import RawSource

if TYPE_CHECKING:  # preflight imports this module: no dask client there (~1 s of imports)
    import distributed

GROUP = "trainflow.sources"
"""Entry-point group under which installed packages register source plug-ins by name."""
SCRATCH = ".raw-part-{index:05d}.npy"
"""A part's inputs as a worker staged them (deleted once the shards are written)."""
SCRATCH_TARGETS = ".raw-part-{index:05d}.y.npy"
"""A part's targets as a worker staged them (deleted once the shards are written)."""
BUILTINS = {
    "arrays": "trainflow.tasks.preprocess.array_source:ArrayFiles",
    "parquet": "trainflow.tasks.preprocess.parquet_source:ParquetFiles",
    "hf_dataset": "trainflow.tasks.preprocess.hf_source:SavedDataset",
}
"""Built-in sources through this seam, registered like a user's. mnist, folder, npz and
synthetic are not ported: they keep their own listing and worker code (GPU decoding, npz
staging in shard order, lazy generation)."""


@runtime_checkable
class Source(Protocol):
    """What a data-source plug-in implements. Constructed as `Source(**source_args)` on the
    flow's host and pickled to the dask workers (keep it small: paths and settings, not data).

    Optional attribute `classes: list[str]`: class names (classification: target i means
    classes[i]) or the vocabulary (sequence data); without it the classes or vocabulary are
    0..max(target). Optional attribute `num_classes: int | None`: the vocabulary's size where
    its entries go unnamed (a tokenizer's: every id it can give, not only those in the data).
    """

    def parts(self) -> list[Any]:
        """The parts the data is split into (file paths, (start, stop) row ranges...), in a
        fixed order; cheap: runs on the flow's host, reads no data. str(part) names it."""
        ...

    def fingerprint(self, part: Any) -> str:
        """A string that changes whenever the part's data changes (its sha256, or its size
        and mtime): the dataset cache is reused while every part's fingerprint is unchanged."""
        ...

    def read(self, part: Any) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of one part, on a dask worker: inputs (n, ...) of any sample
        shape (float features or images, integer token ids), targets (n,) integer classes,
        (n, T) integer ids per position or float values of any shape (n, ...)."""
        ...


@dataclass(frozen=True)
class PluginSource:
    """A resolved and constructed source plug-in, with what names it in errors."""

    source: Any
    ref: str
    file: str

    def describe(self, part: Any) -> str:
        """`part 'x' of source 'my:Src'`."""
        return f"part {str(part)!r} of source {self.ref!r}"


def open_source(cfg: PreprocessConfig) -> PluginSource:
    """Resolve preprocess.source and construct it with source_args; PluginError (one line
    naming the file and the fix) when it cannot be imported or its constructor raises."""
    resolved = plugins.resolve(
        cfg.source, setting="preprocess.source", group=GROUP, builtins=BUILTINS
    )
    what = f"the source plug-in {cfg.source!r}"
    source = plugins.call(resolved, what, **cfg.source_args)
    missing = [
        m for m in ("parts", "fingerprint", "read") if not callable(getattr(source, m, None))
    ]
    if missing:
        raise plugins.PluginError(
            f"preprocess.source={cfg.source!r}: {type(source).__name__} in {resolved.file} lacks "
            f"{missing}: implement parts(), fingerprint(part) and read(part) "
            "(trainflow.tasks.preprocess.plugin_source.Source)"
        )
    return PluginSource(source, cfg.source, resolved.file)


def list_parts(plugin: PluginSource) -> list[Any]:
    """The source's parts, checked: a non-empty list."""
    parts = _call(plugin, "parts()", plugin.source.parts)
    if not isinstance(parts, list | tuple) or not parts:
        raise DataError(
            f"source {plugin.ref!r}: parts() returned {type(parts).__name__} "
            f"{str(parts)[:60]!r}: return a non-empty list of parts (files, row ranges)"
        )
    return list(parts)


def plugin_fingerprint(cfg: PreprocessConfig) -> str:
    """sha256 of the source's name, arguments and every part's fingerprint (no data read)."""
    plugin = open_source(cfg)
    digest = hashlib.sha256(f"trainflow-plugin-v1\n{cfg.source}\n".encode())
    digest.update(json.dumps(cfg.source_args, sort_keys=True, default=str).encode())
    for part in list_parts(plugin):
        fp = _call(plugin, f"fingerprint({str(part)!r})", plugin.source.fingerprint, part)
        digest.update(f"{part}\t{fp}\n".encode())
    return digest.hexdigest()


def _call(plugin: PluginSource, what: str, fn: Any, *args: Any) -> Any:
    """fn(*args); an exception in the user's code becomes one DataError line."""
    try:
        return fn(*args)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(
            f"source {plugin.ref!r}: {what} raised {plugins.describe(exc)} at "
            f"{plugins.user_frame(exc, plugin.file)}: fix it in {plugin.file}"
        ) from exc


@dataclass(frozen=True)
class PartInfo:
    """What a worker read from one part: where it staged its inputs and targets, their shapes
    and dtypes, and the targets themselves only when they are one class per sample."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    target_file: str
    target_shape: tuple[int, ...]
    target_dtype: str
    classes: np.ndarray | None
    """The targets when they are (n,) integer classes (the client splits by class), else None."""
    max_id: int
    """Largest input id (integer inputs), else -1."""
    target_range: tuple[int, int]
    """(smallest, largest) target of integer targets, else (0, 0)."""


def read_part(plugin: PluginSource, part: Any, index: int, scratch: str) -> PartInfo:
    """Read one part on a worker, check its arrays and stage inputs and targets to scratch
    files beside each other; only class targets come back to the client."""
    x, y = read_arrays(plugin, part)
    file = str(Path(scratch) / SCRATCH.format(index=index))
    np.save(file, np.ascontiguousarray(x), allow_pickle=False)
    target_file = str(Path(scratch) / SCRATCH_TARGETS.format(index=index))
    np.save(target_file, np.ascontiguousarray(y), allow_pickle=False)
    max_id = int(x.max()) if x.dtype == np.int64 else -1
    integer = np.issubdtype(y.dtype, np.integer)
    span = (int(y.min()), int(y.max())) if integer else (0, 0)
    classes = y if integer and y.ndim == 1 else None
    return PartInfo(
        str(part),
        file,
        x.shape,
        x.dtype.str,
        target_file,
        y.shape,
        y.dtype.str,
        classes,
        max_id,
        span,
    )


def read_arrays(plugin: PluginSource, part: Any) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one part in the dtypes trainflow stores, checked; DataError naming
    the part and the source for an exception in read() or unusable arrays."""
    where = plugin.describe(part)
    try:
        x, y = plugin.source.read(part)
    except DataError as exc:  # the source's own one-line message
        raise DataError(f"{where}: {exc}") from exc
    except Exception as exc:
        raise DataError(
            f"{where}: read() raised {plugins.describe(exc)} at "
            f"{plugins.user_frame(exc, plugin.file)}: fix it in {plugin.file}"
        ) from exc
    x, y = _checked(np.asarray(x), where, "inputs"), _checked(np.asarray(y), where, "targets")
    if x.ndim < 2 or len(x) == 0:
        raise DataError(
            f"{where}: inputs have shape {x.shape}; expected (n, ...) with n >= 1 and at least "
            "one axis per sample (reshape scalars to (n, 1))"
        )
    if y.ndim < 1 or len(y) != len(x):
        raise DataError(f"{where}: {len(x)} inputs but targets of shape {y.shape}")
    return x, y


def _checked(a: np.ndarray, where: str, what: str) -> np.ndarray:
    """a in the dtype trainflow stores: uint8 kept, other integers int64, floats float32."""
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.number):
        raise DataError(f"{where}: {what} have dtype {a.dtype}; return numeric arrays")
    if np.issubdtype(a.dtype, np.complexfloating):
        raise DataError(f"{where}: {what} have complex dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.integer):
        return a if a.dtype == np.uint8 and what == "inputs" else a.astype(np.int64)
    a = a.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(a.reshape(len(a), -1)).all(axis=1)) if a.ndim else None
    if bad is not None and len(bad):
        raise DataError(f"{where}: {what} of row {int(bad[0])} hold NaN or infinite values")
    return a


@dataclass(frozen=True)
class PartRows:
    """The parts' staged inputs as one (N, ...) array a shard-writing task takes rows of."""

    files: tuple[str, ...]
    starts: tuple[int, ...]
    """Global row of each part's first row, plus N at the end."""
    sample_shape: tuple[int, ...]
    sample_dtype: str
    target_files: tuple[str, ...] = ()
    """Each part's staged targets (staged into the shards with the inputs)."""
    target_shape: tuple[int, ...] = ()
    """A target's shape (() for one class or value per sample)."""
    target_dtype: str = "int64"

    @property
    def shape(self) -> tuple[int, ...]:
        """`(N, *sample_shape)`."""
        return (self.starts[-1], *self.sample_shape)

    @property
    def ndim(self) -> int:
        """1 + the sample's axes."""
        return 1 + len(self.sample_shape)

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def dtype(self) -> np.dtype:
        """uint8, int64 or float32."""
        return np.dtype(self.sample_dtype)

    def first_nonfinite(self) -> int | None:
        """Checked by the workers as they read each part."""
        return None

    def take(self, rows: np.ndarray, xp: ModuleType = np) -> Any:
        """A new array of module xp holding those rows, read from the staged parts."""
        owner = np.searchsorted(np.asarray(self.starts), rows, side="right") - 1
        out = np.empty((len(rows), *self.sample_shape), self.dtype)
        for part in np.unique(owner):
            mine = np.flatnonzero(owner == part)
            mapped = np.load(self.files[part], mmap_mode="r")
            out[mine] = mapped[rows[mine] - self.starts[part]]
        return xp.asarray(out)


def plan_plugin(
    cfg: PreprocessConfig, client: "distributed.Client", scratch: Path, gather: Any
) -> RawSource:
    """List the parts here, read each on a worker (staged to `scratch`), check they agree."""
    plugin = open_source(cfg)
    parts = list_parts(plugin)
    futures = [
        client.submit(run_guarded, read_part, plugin, part, i, str(scratch), pure=False)
        for i, part in enumerate(parts)
    ]
    infos: list[PartInfo] = gather(client, [futures])[0]
    _agree(infos, plugin)
    starts = tuple(np.concatenate([[0], np.cumsum([i.shape[0] for i in infos])]).tolist())
    first = infos[0]
    files, target_files = tuple(i.file for i in infos), tuple(i.target_file for i in infos)
    rows = PartRows(
        files,
        starts,
        first.shape[1:],
        first.dtype,
        target_files,
        first.target_shape[1:],
        first.target_dtype,
    )
    targets: np.ndarray | TargetSummary
    if first.classes is not None:
        targets = np.concatenate([i.classes for i in infos if i.classes is not None])
    else:
        low = min(i.target_range[0] for i in infos)
        high = max(i.target_range[1] for i in infos)
        targets = TargetSummary(starts[-1], first.target_shape[1:], first.target_dtype, low, high)
    classes, num_classes = classes_of(plugin, targets, max(i.max_id for i in infos))
    return RawSource(rows, targets, classes, num_classes)


@dataclass(frozen=True)
class TargetSummary:
    """What the client knows of targets that stay on the workers (ids per position, float
    values): their count, sample shape, dtype and range. Quacks as the array would for
    validation, splitting and the manifest; the values themselves are never here."""

    count: int
    sample_shape: tuple[int, ...]
    sample_dtype: str
    low: int
    """Smallest target (integer targets), else 0."""
    high: int
    """Largest target (integer targets), else 0."""

    @property
    def shape(self) -> tuple[int, ...]:
        """`(N, *sample_shape)`."""
        return (self.count, *self.sample_shape)

    @property
    def ndim(self) -> int:
        """1 + the sample's axes."""
        return 1 + len(self.sample_shape)

    @property
    def dtype(self) -> np.dtype:
        """int64 or float32."""
        return np.dtype(self.sample_dtype)

    def __len__(self) -> int:
        return self.count

    def min(self) -> int:
        """The smallest target (integer targets)."""
        return self.low

    def max(self) -> int:
        """The largest target (integer targets)."""
        return self.high


def _agree(infos: list[PartInfo], plugin: PluginSource) -> None:
    """DataError naming a part whose shapes or dtypes differ from the first part's."""
    first = infos[0]
    for info in infos[1:]:
        for what, mine, theirs in (
            ("inputs", (info.shape[1:], info.dtype), (first.shape[1:], first.dtype)),
            ("targets", _target_kind(info), _target_kind(first)),
        ):
            if mine != theirs:
                raise DataError(
                    f"{plugin.describe(info.name)}: {what} of sample shape and dtype {mine} "
                    f"differ from {theirs} in part {first.name!r}: every part must agree"
                )


def _target_kind(info: PartInfo) -> tuple[tuple[int, ...], str]:
    return info.target_shape[1:], info.target_dtype


def classes_of(
    plugin: PluginSource, targets: "np.ndarray | TargetSummary", max_input_id: int
) -> tuple[list[str], int | None]:
    """Class names and the number of classes (or vocabulary size); ([], None) for floats."""
    names = getattr(plugin.source, "classes", None)
    size = getattr(plugin.source, "num_classes", None)
    if names is None and isinstance(size, int):
        return [], size
    if names is not None:
        names = [str(n) for n in names]
        return names, len(names)
    if not np.issubdtype(targets.dtype, np.integer):
        return [], None
    n = max(int(targets.max()), max_input_id) + 1
    if targets.ndim == 1:
        return [str(i) for i in range(n)], n
    return [], n
