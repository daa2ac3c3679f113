"""The npz source's files: which a path holds, and one read (images, labels, optional class
names), checked."""

import zipfile
from pathlib import Path

import numpy as np

from trainflow.errors import DataError


def npz_files(path: Path) -> list[Path]:
    """The .npz file itself, or the sorted .npz files of a folder."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".npz")
    if not files:
        raise DataError(f"no .npz files in folder {str(path)!r} (source='npz')")
    return files


def read_npz(file: Path, want_classes: bool) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    """Images (N,C,H,W), labels int64 and optional class names of one checked file."""
    if file.stat().st_size == 0:
        raise DataError(f"npz file {str(file)!r} is empty (0 bytes): remove or replace it")
    try:
        with _open_npz(file) as data:
            missing = [k for k in ("images", "labels") if k not in data.files]
            if missing:
                raise DataError(
                    f"npz file {str(file)!r} lacks {missing}: it has keys {sorted(data.files)}; "
                    "expected 'images' and 'labels' (optional 'classes')"
                )
            arrays = {k: data[k] for k in data.files if k in ("images", "labels", "classes")}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"cannot read npz file {str(file)!r} (corrupt?): {exc}") from exc
    images = _npz_images(file, arrays["images"])
    labels = npz_labels(file, arrays["labels"], len(images))
    classes = arrays.get("classes") if want_classes else None
    return images, labels, None if classes is None else [str(c) for c in classes.ravel()]


def _open_npz(file: Path) -> np.lib.npyio.NpzFile:
    data = np.load(file, allow_pickle=False)
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise DataError(f"{str(file)!r} holds a single array, not an .npz archive (np.savez)")
    return data


def _npz_images(file: Path, images: np.ndarray) -> np.ndarray:
    """Channels-first uint8 or float32 images, finite and non-empty."""
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):
        images = images.transpose(0, 3, 1, 2)
    elif images.ndim != 4:
        raise DataError(
            f"{str(file)!r}: 'images' has shape {images.shape}; expected (N,H,W), "
            "(N,C,H,W) or (N,H,W,C)"
        )
    if images.size == 0:
        raise DataError(f"{str(file)!r}: 'images' is empty (shape {images.shape})")
    if images.dtype == np.bool_ or not np.issubdtype(images.dtype, np.number):
        raise DataError(f"{str(file)!r}: 'images' has non-numeric dtype {images.dtype}")
    if images.dtype != np.uint8:
        images = images.astype(np.float32)
        if not np.isfinite(images).all():
            raise DataError(f"{str(file)!r}: 'images' holds NaN or infinite values")
    return np.ascontiguousarray(images)


def npz_labels(file: Path, labels: np.ndarray, count: int) -> np.ndarray:
    """int64 labels, one per image, none negative; DataError naming the file otherwise."""
    if labels.ndim != 1:
        raise DataError(f"{str(file)!r}: 'labels' has shape {labels.shape}; expected (N,)")
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"{str(file)!r}: 'labels' has dtype {labels.dtype}; expected integers (class indices)"
        )
    if len(labels) != count:
        raise DataError(f"{str(file)!r}: {count} images but {len(labels)} labels")
    if labels.min() < 0:
        raise DataError(f"{str(file)!r}: negative label {int(labels.min())}")
    return labels.astype(np.int64)
