"""Checkpoints: atomic writes of the full training state, resume look-up, best-model export.

Everything stored loads under ``torch.load(weights_only=True)`` (tensors, numbers, strings,
lists, dicts, tuples, None), so loading a checkpoint never runs pickled code.

The last KEEP checkpoints are kept (or those a `Retain` names: train.keep_checkpoints,
tasks.train.monitor), each next to ``<name>.sha256`` (sha256sum's format) that is
written before the checkpoint is renamed into place. On resume the newest one whose bytes match
their hash and that loads is taken; a truncated or corrupted newer one is skipped, and said so.
"""

import hashlib
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainflow.errors import DataError
from trainflow.tasks.hashing import sha256_file

_NAME = "epoch-{epoch:06d}.pt"
_MID_NAME = "epoch-{epoch:06d}+{batches:06d}.pt"
"""A checkpoint taken inside an epoch (before a time limit): `epoch` epochs done, then
`batches` of the next epoch's batches (per rank)."""
_PATTERN = re.compile(r"^epoch-(\d{6})(?:\+(\d{6}))?\.pt$")
_HASH_SUFFIX = ".sha256"
KEEP = 2
"""Checkpoints kept on disk: the newest, and one to fall back to when it is unreadable."""

Retain = Callable[[list[Path], Sequence[dict[str, Any]]], set[str]]
"""Which checkpoints a folder keeps: given its checkpoints newest first and the run's history
(one entry per validation), the names to keep (full checkpoint files and sharded folders
alike; the one just written is always kept)."""


def newest_kept(newest_first: list[Path], history: Sequence[dict[str, Any]]) -> set[str]:
    """The default Retain: the KEEP newest."""
    return {p.name for p in newest_first[:KEEP]}


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


class _HashingWriter:
    """A write-only file wrapper that hashes every byte on its way to disk."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def atomic_save(obj: Any, path: Path, hash_file: bool = False) -> str:
    """torch.save to a temporary file, fsync, then rename: readers never see half a file.

    Returns the sha256 of the bytes written. With `hash_file`, ``<path>.sha256`` is written
    (atomically) before the rename, so a checkpoint on disk always has its hash next to it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)  # type: ignore[arg-type]  # torch only calls write/flush
            f.flush()
            os.fsync(f.fileno())
        sha256 = writer.digest.hexdigest()
        if hash_file:
            _write_atomically(_hash_path(path), f"{sha256}  {path.name}\n".encode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # the rename is durable only once the directory entry is flushed
    return sha256


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(directory: Path) -> None:
    """Flush `directory`'s entries (a rename into it is durable only then)."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _hash_path(path: Path) -> Path:
    return path.with_name(path.name + _HASH_SUFFIX)


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


def save_checkpoint(state: dict[str, Any], directory: Path, keep: Retain = newest_kept) -> Path:
    """Write `state` (with its .sha256) as the latest checkpoint of directory.

    Keeps the checkpoints `keep` names (by default the KEEP newest) and deletes the others,
    their hashes and stale temporary files of interrupted writes.
    """
    epoch, batches = int(state["epoch"]), int(state.get("epoch_batches", 0))
    name = _MID_NAME if batches else _NAME
    path = directory / name.format(epoch=epoch, batches=batches)
    atomic_save(state, path, hash_file=True)
    kept = keep(checkpoints(directory), state.get("history", [])) | {path.name}
    kept |= {name + _HASH_SUFFIX for name in kept}
    for old in directory.iterdir():
        stale = _PATTERN.match(old.name.removesuffix(_HASH_SUFFIX)) or ".tmp-" in old.name
        if stale and old.name not in kept:
            old.unlink(missing_ok=True)
    return path


def checkpoints(directory: Path) -> list[Path]:
    """The checkpoints in directory, newest (highest epoch, then batches into the next) first;
    [] when there is none."""
    return newest_first(directory, _PATTERN)


def newest_first(directory: Path, pattern: re.Pattern[str]) -> list[Path]:
    """The entries of directory whose names `pattern` matches (group 1: epochs done, group 2,
    optional: batches into the next), newest first; [] when there is no directory. Full and
    sharded checkpoints share it: files `epoch-E[+B].pt`, folders `epoch-E[+B]`."""
    if not directory.is_dir():
        return []
    found = [
        ((int(m.group(1)), int(m.group(2) or 0)), p)
        for p in directory.iterdir()
        if (m := pattern.match(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_epoch(path: Path) -> int:
    """The epochs done when the checkpoint at `path` was written (from its name)."""
    match = _PATTERN.match(path.name)
    return int(match.group(1)) if match else 0


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint of the highest epoch in directory, or None when there is none."""
    found = checkpoints(directory)
    return found[0] if found else None


@dataclass(frozen=True)
class Resumable:
    """The checkpoint a job resumes from, and the newer ones it had to pass over."""

    path: Path
    state: dict[str, Any]
    skipped: list[str] = field(default_factory=list)
    """One line per newer checkpoint that did not verify: its path and why."""


def resumable_checkpoint(directory: Path) -> Resumable | None:
    """The newest checkpoint of directory that matches its sha256 and loads, with its state.

    None when directory holds no checkpoint. DataError when none of them verifies: resuming
    from scratch silently would throw the run's progress away.
    """
    skipped: list[str] = []
    for path in checkpoints(directory):
        problem = _verify(path)
        if problem is None:
            try:
                return Resumable(path, load_state(path), skipped)
            except Exception as exc:  # unreadable despite its hash (e.g. an old torch)
                first_line = str(exc).strip().split("\n", 1)[0]
                problem = f"does not load ({type(exc).__name__}: {first_line})"
        skipped.append(f"{path} {problem}")
    if skipped:
        raise DataError(
            "no checkpoint to resume from verifies: " + "; ".join(skipped) + f". Restore one, "
            f"or delete {directory} to start this run from scratch"
        )
    return None


def _verify(path: Path) -> str | None:
    """Why `path` cannot be trusted (its bytes do not match its recorded sha256), or None.

    A checkpoint without a .sha256 (written before hashes were kept) is left to torch.load.
    """
    hash_path = _hash_path(path)
    if not hash_path.exists():
        return None
    recorded = hash_path.read_text().split(maxsplit=1)[:1]
    actual = sha256_file(path)
    if recorded != [actual]:
        size = path.stat().st_size
        return f"does not match its recorded sha256 ({size} bytes: truncated or corrupted)"
    return None


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
