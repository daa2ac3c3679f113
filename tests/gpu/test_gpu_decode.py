"""GPU JPEG decode (torchvision/nvJPEG) gives the CPU path's pixels within rounding, and the
CPU fallback takes what the GPU decoder cannot read. Skipped without CUDA, CuPy, torchvision."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainflow.tasks.preprocess.worker_sources import FolderImages

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run: make gpu)"),
]
cupy = pytest.importorskip("cupy")
pytest.importorskip("torchvision")


def _files(root: Path) -> list[str]:
    """Smooth 256x256 JPEGs (colour and gray), a PNG and a CMYK JPEG (CPU fallbacks)."""
    root.mkdir()
    yy, xx = np.mgrid[0:256, 0:256]
    files = []
    for i in range(40):
        rgb = np.stack([(xx + 7 * i) % 256, (yy + 3 * i) % 256, (xx + yy) // 2], -1)
        img = Image.fromarray(rgb.astype(np.uint8))
        if i % 5 == 0:
            img = img.convert("L")
        files.append(root / f"{i:03d}.jpg")
        img.save(files[-1], quality=90)
    Image.fromarray(np.zeros((256, 256, 3), np.uint8) + 90).save(root / "flat.png")
    Image.new("CMYK", (256, 256), (10, 20, 30, 0)).save(root / "cmyk.jpg")
    return [str(f) for f in files] + [str(root / "flat.png"), str(root / "cmyk.jpg")]


@pytest.mark.parametrize("size", [(64, 64), (256, 256)])
def test_gpu_decode_matches_the_cpu_path(tmp_path: Path, size: tuple[int, int]) -> None:
    files = _files(tmp_path / "imgs")
    images = FolderImages(tuple(files), 3, size, resize=size != (256, 256))
    rows = np.arange(len(files))
    cpu = images.take(rows, np)
    gpu = cupy.asnumpy(images.take(rows, cupy))
    assert gpu.shape == cpu.shape == (len(files), 3, *size) and gpu.dtype == np.uint8
    diff = np.abs(gpu.astype(np.int16) - cpu.astype(np.int16))
    # nvJPEG and libjpeg-turbo differ in IDCT/upsampling rounding; the resize rounds once more.
    assert diff.mean() <= 1.0, diff.mean()
    assert np.percentile(diff, 99.9) <= 4, np.percentile(diff, 99.9)
    # The PNG took the CPU path on the GPU worker too: identical. (The CMYK JPEG, which
    # nvJPEG may or may not take, is within the tolerance above either way.)
    np.testing.assert_array_equal(gpu[-2], cpu[-2])
