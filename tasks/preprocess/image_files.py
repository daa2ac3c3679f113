"""The folder source's image files: class folders, their files, one file read, sizes compared.

Shared by the in-process loader (sources), the workers (worker_sources, gpu_decode) and the
header-only checks (preflight), so each reads and judges a file the same way.
"""

from pathlib import Path

import numpy as np
from PIL import Image

from trainflow.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
"""Files of a class folder that are read as images (case-insensitive)."""
GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")
"""PIL modes read as one channel; every other mode becomes RGB."""


def class_dirs(root: Path) -> list[Path]:
    """The class folders under root, sorted; DataError when root is no folder or holds none."""
    if not root.is_dir():
        raise DataError(f"preprocess.path {str(root)!r} is not a folder (source='folder')")
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not dirs:
        raise DataError(
            f"no class folders in {str(root)!r}: source='folder' expects one sub-folder "
            "per class holding .png/.jpg/.jpeg images"
        )
    return dirs


def class_images(class_dir: Path) -> list[Path]:
    """The class's image files, sorted; DataError when it holds none (an empty class)."""
    files = sorted(
        p for p in class_dir.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    )
    if not files:
        raise DataError(
            f"class folder {str(class_dir)!r} holds no .png/.jpg/.jpeg images: "
            "add images or remove the folder"
        )
    return files


def image_files(root: Path) -> list[Path]:
    """Every image the folder loader reads, in load order."""
    return [f for d in class_dirs(root) for f in class_images(d)]


def read_image(file: Path, size: tuple[int, int] | None) -> np.ndarray:
    """(H, W) for grayscale or (H, W, 3) for colour, uint8; alpha channels are dropped."""
    if file.stat().st_size == 0:
        raise DataError(f"image file {str(file)!r} is empty (0 bytes): remove or replace it")
    try:
        with Image.open(file) as img:
            img.load()
            array = _to_array(img, size)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(
            f"cannot read image {str(file)!r} (corrupt or not an image): {exc}"
        ) from exc
    return array


def _to_array(img: Image.Image, size: tuple[int, int] | None) -> np.ndarray:
    """Grayscale modes become L, everything else (palette, CMYK, alpha...) RGB."""
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    img = img.convert("L" if img.mode in GRAY_MODES else "RGB")
    if size is not None:
        img = img.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return np.asarray(img, dtype=np.uint8)


def check_same_size(file: Path, size: tuple[int, ...], first: tuple[Path, tuple[int, ...]]) -> None:
    """DataError naming `file` when its (H, W) `size` differs from that of `first` (a file
    and its size), with the setting that resizes them all."""
    if size != first[1]:
        (h, w), (h0, w0) = size, first[1]
        raise DataError(
            f"image {str(file)!r} is {h}x{w} (HxW) but {str(first[0])!r} is {h0}x{w0}: "
            f"all images must share one size, or set preprocess.image_size=[{h0},{w0}] "
            "to resize them"
        )
