"""Checks every raw source must pass before any expensive work starts."""

import numpy as np

from trainflow.errors import DataError
from trainflow.tasks.preprocess.raw import LazyTargets, RawData, RawSource

MIN_SAMPLES = 10
_CHECK_ROWS = 4096  # rows per finiteness check: bounded temporaries at any data size


def validate_raw(raw: RawData | RawSource, origin: str, images: bool = True) -> None:
    """Raise DataError (prefixed with origin) unless raw is a usable data set.

    images=True (the built-in sources): (N, C, H, W) inputs and class labels. Else (source
    plug-ins) inputs of any sample shape and targets that are classes (N,), ids per position
    (N, T) or floats of any shape; float targets were checked finite by the workers.
    """
    _check_shapes(raw, origin, images)
    _check_values(raw, origin)
    if images or is_class_labels(raw.labels):
        _check_labels(raw, origin)
    elif np.issubdtype(raw.labels.dtype, np.integer):
        _check_ids(raw, origin)


def is_class_labels(targets: "np.ndarray | LazyTargets") -> bool:
    """True for one integer class per sample: (N,) integers."""
    return targets.ndim == 1 and np.issubdtype(targets.dtype, np.integer)


def _check_shapes(raw: RawData | RawSource, origin: str, images: bool) -> None:
    if images and raw.images.ndim != 4:
        raise DataError(f"{origin}: images have shape {raw.images.shape}; expected (N, C, H, W)")
    if raw.images.ndim < 2:
        raise DataError(
            f"{origin}: inputs have shape {raw.images.shape}; expected (N, ...) with at least "
            "one axis per sample, e.g. (N, F) features: reshape scalars to (N, 1)"
        )
    if (images and raw.labels.ndim != 1) or len(raw.labels) != len(raw.images):
        what = "images but labels" if images else "samples but targets"
        raise DataError(f"{origin}: {len(raw.images)} {what} of shape {raw.labels.shape}")
    if min(raw.images.shape[1:]) < 1:
        what = "images" if images else "samples"
        raise DataError(f"{origin}: {what} have an empty dimension: {raw.images.shape}")
    if len(raw.images) < MIN_SAMPLES:
        raise DataError(
            f"{origin}: only {len(raw.images)} samples; at least {MIN_SAMPLES} are needed "
            "to split into train/val/test"
        )


def _check_values(raw: RawData | RawSource, origin: str) -> None:
    dtype = raw.images.dtype
    if dtype == np.bool_ or not np.issubdtype(dtype, np.number):
        raise DataError(f"{origin}: images have non-numeric dtype {dtype}")
    if np.issubdtype(dtype, np.complexfloating):
        raise DataError(f"{origin}: images have complex dtype {dtype}")
    if not np.issubdtype(dtype, np.floating):
        return
    images = raw.images
    bad = _first_nonfinite(images) if isinstance(images, np.ndarray) else images.first_nonfinite()
    if bad is not None:
        raise DataError(f"{origin}: image {bad} holds NaN or infinite values")


def _first_nonfinite(images: np.ndarray) -> int | None:
    """Index of the first image holding NaN/inf, None when all are finite."""
    for start in range(0, len(images), _CHECK_ROWS):
        block = images[start : start + _CHECK_ROWS].reshape(-1, int(np.prod(images.shape[1:])))
        bad = np.flatnonzero(~np.isfinite(block).all(axis=1))
        if len(bad):
            return start + int(bad[0])
    return None


def _check_ids(raw: RawData | RawSource, origin: str) -> None:
    """Integer targets per position: ids in [0, num_classes)."""
    low, high = int(raw.labels.min()), int(raw.labels.max())
    n = raw.num_classes or high + 1
    if low < 0 or high >= n:
        raise DataError(
            f"{origin}: target ids range over [{low}, {high}] but the vocabulary has {n} "
            f"entries (ids must lie in [0, {n - 1}])"
        )


def _check_labels(raw: RawData | RawSource, origin: str) -> None:
    if not isinstance(raw.labels, np.ndarray):  # plug-ins send class targets to the client
        raise TypeError(f"{origin}: class labels must reach the client as an array")
    if not np.issubdtype(raw.labels.dtype, np.integer):
        raise DataError(f"{origin}: labels have dtype {raw.labels.dtype}; expected integers")
    n_classes = len(raw.classes)
    if n_classes < 2 or len(set(raw.classes)) != n_classes:
        raise DataError(f"{origin}: need at least 2 distinct class names, got {raw.classes}")
    low, high = int(raw.labels.min()), int(raw.labels.max())
    if low < 0 or high >= n_classes:
        raise DataError(
            f"{origin}: labels range over [{low}, {high}] but there are {n_classes} classes "
            f"(labels must lie in [0, {n_classes - 1}])"
        )
    counts = np.bincount(raw.labels, minlength=n_classes)
    empty = [raw.classes[i] for i in np.flatnonzero(counts == 0)]
    if empty:
        raise DataError(f"{origin}: classes without any sample: {empty[:10]}")
