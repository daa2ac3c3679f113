"""JPEG decode and resize on the GPU of a dask-cuda worker, PIL for what it cannot read.

Library: torchvision.io.decode_jpeg on CUDA (nvJPEG), in batches, plus torch's antialiased
bilinear resize. It keeps the pixels in torch/CUDA memory that CuPy takes without a copy
(DLPack), and its resize (antialias=True) is written to follow PIL's BILINEAR. nvImageCodec
(hardware JPEG decoders) would slot in behind `_decode_batch`. Installed by the `gpu` extra only:
PyPI's torchvision does not import beside the CPU torch wheel of the CPU machines.

Falls back to FolderImages.decode_cpu, file by file, for PNGs, for JPEGs nvJPEG rejects
(CMYK, progressive with unsupported features, corrupt data) and when torchvision is missing;
corrupt files then raise the CPU path's DataError naming the file.
"""

import logging
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from trainflow.tasks.preprocess.image_files import check_same_size

log = logging.getLogger(__name__)

JPEG_SUFFIXES = (".jpg", ".jpeg")


class Pictures(Protocol):
    """The images being decoded, as the decoder needs them (worker_sources.FolderImages)."""

    @property
    def files(self) -> tuple[str, ...]:
        """Every file of the dataset, the first one the size reference."""
        ...

    @property
    def channels(self) -> int:
        """1 or 3."""
        ...

    @property
    def size(self) -> tuple[int, int]:
        """(H, W) of every decoded image."""
        ...

    @property
    def resize(self) -> bool:
        """True: images of another size are resized to `size`; False: they are an error."""
        ...

    def decode_cpu(self, name: str) -> np.ndarray:
        """One file as (C, H, W) uint8 on the CPU: what the GPU decoder cannot read."""
        ...


def decode_files_gpu(names: list[str], images: Pictures, xp: ModuleType) -> Any:
    """(len(names), C, H, W) uint8 CuPy array of the files, decoded on the current GPU."""
    import torch

    device = torch.device("cuda", int(xp.cuda.Device().id))
    out = torch.empty((len(names), images.channels, *images.size), dtype=torch.uint8, device=device)
    jpegs = [i for i, n in enumerate(names) if Path(n).suffix.lower() in JPEG_SUFFIXES]
    decoded = _decode_batch([names[i] for i in jpegs], images.channels, device)
    done = set()
    for i, picture in zip(jpegs, decoded, strict=True):
        if picture is not None:
            out[i] = _fit(picture, names[i], images)
            done.add(i)
    for i, name in enumerate(names):
        if i not in done:
            out[i] = torch.from_numpy(images.decode_cpu(name)).to(device)
    return xp.from_dlpack(out)


def _decode_batch(files: list[str], channels: int, device: Any) -> list[Any]:
    """Each file decoded to a (C, h, w) uint8 CUDA tensor, or None where nvJPEG cannot."""
    if not files:
        return []
    try:
        from torchvision.io import ImageReadMode, decode_jpeg, read_file
    except ImportError:
        log.warning("torchvision is not installed: JPEGs are decoded on the CPU")
        return [None] * len(files)
    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    data = [read_file(f) for f in files]
    try:
        return list(decode_jpeg(data, mode=mode, device=device))
    except RuntimeError:
        pass  # one file spoiled the batch: find which, file by file
    result = []
    for one in data:
        try:
            result.append(decode_jpeg(one, mode=mode, device=device))
        except RuntimeError:
            result.append(None)
    return result


def _fit(picture: Any, name: str, images: Pictures) -> Any:
    """The decoded picture at the dataset's size: resized (image_size set) or checked."""
    import torch

    height, width = int(picture.shape[-2]), int(picture.shape[-1])
    if (height, width) == images.size:
        return picture
    if not images.resize:
        check_same_size(Path(name), (height, width), (Path(images.files[0]), images.size))
    resized = torch.nn.functional.interpolate(
        picture[None].float(), size=images.size, mode="bilinear", antialias=True
    )
    return resized[0].round_().clamp_(0, 255).to(torch.uint8)
