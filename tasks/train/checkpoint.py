"""Checkpoints: atomic writes of the full training state, resume look-up, best-model export.

Everything stored loads under ``torch.load(weights_only=True)`` (tensors, numbers, strings,
lists, dicts, tuples, None), so loading a checkpoint never runs pickled code.
"""

import os
import random
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_NAME = "epoch-{epoch:06d}.pt"
_PATTERN = re.compile(r"^epoch-(\d{6})\.pt$")


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file, fsync, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename is durable only once the directory entry is flushed too.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device) and python `random` state, weights_only-loadable."""
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the generators saved by rng_state()."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    progress: dict[str, Any],
) -> dict[str, Any]:
    """The full resumable state: weights, optimizer, scaler, RNG and `progress`.

    `progress` holds epoch, step, history, best_metric, data_seed and anything else plain.
    """
    return {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rng_state(),
        **progress,
    }


def save_checkpoint(state: dict[str, Any], directory: Path) -> Path:
    """Write `state` as the latest checkpoint of directory and delete the older ones."""
    path = directory / _NAME.format(epoch=int(state["epoch"]))
    atomic_save(state, path)
    for old in directory.iterdir():
        if old != path and (_PATTERN.match(old.name) or ".pt.tmp-" in old.name):
            old.unlink(missing_ok=True)
    return path


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint of the highest epoch in directory, or None when there is none."""
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _PATTERN.match(p.name))]
    return max(found)[1] if found else None


def load_state(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by this module onto the CPU (weights_only: runs no code).

    CPU on purpose: RNG states must stay CPU tensors, and load_state_dict moves the rest.
    """
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def save_best(model: nn.Module, path: Path, meta: dict[str, Any]) -> None:
    """Write the model's weights plus `meta` (plain values) as the best model, atomically."""
    save_best_weights(unwrap(model).state_dict(), path, meta)


def save_best_weights(weights: dict[str, Any], path: Path, meta: dict[str, Any]) -> None:
    """Write a state_dict plus `meta` as the best model, atomically (see save_best)."""
    atomic_save({"model": weights, "meta": meta}, path)


def host_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory, through dicts, lists and tuples.

    A snapshot of a training state that later steps cannot change: state_dict() returns the
    live parameter and optimizer tensors themselves.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(host_copy(v) for v in obj)
    return obj
