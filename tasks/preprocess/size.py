"""How much disk preprocessing takes, for pre-flight and for a full disk's error message."""

import json
import math
from pathlib import Path

from trainflow.tasks.preprocess.config import PreprocessConfig

_MNIST = (5000, 1 * 28 * 28)


def dataset_bytes(cfg: PreprocessConfig) -> int | None:
    """Bytes written at the peak: float32 samples plus int64 labels for the generated source;
    MNIST's uint8 pixels twice (the staged copy beside the shards) plus labels; for files, the
    size of the source files (a lower bound: decoded images are larger); None if unknown."""
    if cfg.source == "synthetic":
        return cfg.synthetic_samples * (4 * math.prod(cfg.synthetic_shape) + 8)
    if cfg.source == "mnist":
        n, pixels = _MNIST
        return n * (2 * pixels + 8)
    return _tree_bytes(cfg.path) if cfg.path else None


def array_bytes(cfg: PreprocessConfig) -> int | None:
    """The dataset's size where the source's bytes are its samples' (generated, MNIST, .npz
    arrays), else None: an image folder decodes to more than its files, and a plug-in's size is
    unknown (its code is the user's: it runs in worker processes, apart from the flow)."""
    return dataset_bytes(cfg) if cfg.source in ("synthetic", "mnist", "npz") else None


def preprocess_need(cfg: PreprocessConfig, out_root: Path) -> int | None:
    """What preprocessing `cfg` will write under `out_root`, known before it starts: the
    generated and bundled sources' exact sizes; 0 when a dataset of this config is there
    already (the cache serves it); None for files, whose decoded size needs their pixels."""
    if cfg.source not in ("synthetic", "mnist"):
        return None
    wanted = cfg.model_dump(mode="json")
    for manifest in out_root.glob("*/manifest.json") if out_root.is_dir() else []:
        try:
            if json.loads(manifest.read_text()).get("config") == wanted:
                return 0
        except (OSError, ValueError):
            continue
    return dataset_bytes(cfg)


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
