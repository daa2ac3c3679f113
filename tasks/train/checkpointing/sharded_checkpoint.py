"""Sharded checkpoints of train.strategy=fsdp runs (torch.distributed.checkpoint, DCP).

Each rank writes only the shard of the weights and optimizer state it holds; loading reshards,
so a checkpoint written by N ranks resumes on M. Layout of one checkpoint (a folder):

    checkpoints/epoch-000003/
        __0_0.distcp, __1_0.distcp, ...   one file per saving rank: its shards (DCP)
        .metadata                          DCP's index: which shard of which tensor is where
        train_state.pt                     rank 0: progress (step, epoch, history, data seed),
                                           RNG, loss scaler, run identity (weights_only)
        SHA256SUMS                         sha256sum format, of every file above; written last

A checkpoint is written under `<name>.tmp` and renamed into place once every rank's
shard, the metadata, train_state.pt and SHA256SUMS are on disk: a folder without `.tmp` is
whole. The last KEEP are kept (or those train.keep_checkpoints names: tasks.train.monitor);
on resume rank 0 takes the newest whose files match their hashes, says which newer ones it
skipped and why, and every rank loads that one.

To load one elsewhere (no trainflow, any number of processes, or none):
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(folder, "model.pt")`` gives
one torch.save file of the whole state ({"model": ..., "optimizer": ...}), or
``dcp.load({"model": model.state_dict()}, checkpoint_id=folder)`` fills a plain model.
"""

import hashlib
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainflow.console import say
from trainflow.errors import ConfigError, DataError
from trainflow.tasks.train.checkpointing.checkpoint import (
    Resumable,
    Retain,
    atomic_save,
    checkpoints,
    fsync_dir,
    load_state,
    newest_first,
    newest_kept,
    resumable_checkpoint,
)
from trainflow.tasks.train.distributed import DistContext

_PATTERN = re.compile(r"^epoch-(\d{6})(?:\+(\d{6}))?$")
SUMS = "SHA256SUMS"
"""The hash list of a sharded checkpoint: the file written last."""
SETTLE_S = 30.0
"""How long a failing job waits for its checkpoint in flight before it gives up on it."""
TRAIN_STATE = "train_state.pt"
"""Rank 0's progress, RNG and scaler state: the same on every rank, stored once."""


def sharded_checkpoints(directory: Path) -> list[Path]:
    """The sharded checkpoint folders of directory, newest (highest epoch, then steps into
    the next) first."""
    return newest_first(directory, _PATTERN)


def checkpoint_name(epoch: int, steps: int = 0) -> str:
    """The folder name of the checkpoint after `epoch` epochs and `steps` steps of the next."""
    return f"epoch-{epoch:06d}+{steps:06d}" if steps else f"epoch-{epoch:06d}"


class ShardedSaver:
    """Writes an fsdp run's checkpoints off the training's critical path, one in flight.

    `save` copies this rank's shards to host memory (DCP's staging: one copy of 1/N of the
    state) and returns; a thread writes them. Its collectives (DCP's plan and its finish,
    when rank 0 writes `.metadata`) run on a gloo group of their own, so they never interleave
    with the training's. The next `save`, and `wait` at the end of training, wait for the one
    in flight; then rank 0 writes train_state.pt and SHA256SUMS and renames the folder into
    place. A job that dies before that leaves `<name>.tmp`, which resume ignores (the
    previous checkpoint is kept for that) and the next save deletes.

    `timed`, on rank 0: told the seconds each save took, from its start until its shards are
    written (as soon as they are), then again with the finishing writes added (in `wait`).
    `keep`: which checkpoints the folder keeps once one is in place (the KEEP newest).
    """

    def __init__(
        self,
        ctx: DistContext,
        timed: Callable[[float], None] | None = None,
        keep: Retain = newest_kept,
    ) -> None:
        self.ctx, self.keep = ctx, keep
        _quiet_dcp()
        self.group = dist.new_group(backend="gloo") if ctx.world_size > 1 else None
        """DCP's collectives (collective to create: every rank makes its saver together)."""
        self.timed = timed if ctx.is_main else None
        self._pending: tuple[Future[Any], Path, dict[str, Any]] | None = None
        self._started, self._written = 0.0, 0.0

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
        directory: Path,
        epoch: int,
        steps: int = 0,
    ) -> None:
        """Start writing the checkpoint after `epoch` epochs and `steps` steps of the next
        (every rank calls it, with its shards; `train_state`, a snapshot of progress, RNG and
        scaler, is taken from rank 0)."""
        self.wait()
        tmp = directory / f"{checkpoint_name(epoch, steps)}.tmp"
        if self.ctx.is_main:  # before DCP's planning collective: no rank writes before this
            shutil.rmtree(tmp, ignore_errors=True)  # a killed attempt's, perhaps of more ranks
            # exist_ok: the other ranks' DCP writers create the folder too, before planning
            tmp.mkdir(parents=True, exist_ok=True)
        import torch.distributed.checkpoint as dcp  # (see _dcp_state)

        self._started = time.monotonic()
        sd = _dcp_state()
        options = sd.StateDictOptions(flatten_optimizer_state_dict=True)
        model_state, optim_state = sd.get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optimizer": optim_state}
        future = dcp.async_save(
            state, checkpoint_id=tmp, process_group=self.group, no_dist=self.group is None
        )
        assert isinstance(future, Future)  # the thread executor's (no zero-overhead stager)
        future.add_done_callback(self._shards_written)
        self._pending = (future, tmp, train_state)

    def _shards_written(self, future: Future[Any]) -> None:
        self._written = time.monotonic()
        if self.timed is not None and future.exception() is None:
            self.timed(self._written - self._started)

    def wait(self, timeout_s: float | None = None) -> Path | None:
        """Wait for the checkpoint in flight, if any (at most `timeout_s`), and put it in
        place (rank 0); its folder, or None when none was in flight. Raises what the write
        raised (TimeoutError after `timeout_s`)."""
        if self._pending is None:
            return None
        future, tmp, train_state = self._pending
        self._pending = None
        future.result(timeout_s)  # on rank 0: every rank's shards and .metadata are written
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        if self.ctx.is_main:
            finishing = time.monotonic()
            atomic_save(train_state, tmp / TRAIN_STATE)
            _write_sums(tmp)
            shutil.rmtree(final, ignore_errors=True)  # the same epoch written again
            os.replace(tmp, final)
            fsync_dir(final.parent)
            kept = self.keep(sharded_checkpoints(final.parent), train_state.get("history", []))
            _prune(final.parent, kept | {final.name})
            # (the callback may not have run yet: then the shards were written just now)
            written = self._written if self._written >= self._started else finishing
            if self.timed is not None:
                self.timed(written - self._started + time.monotonic() - finishing)
        return final

    def settle(self, timeout_s: float = SETTLE_S) -> None:
        """On the way out of a failing job: put the checkpoint in flight in place if it
        completes within `timeout_s` (its peers may be gone), else leave it; never raises."""
        try:
            self.wait(timeout_s)
        except Exception as exc:  # the job's own error is the one to report
            say(f"warning: the checkpoint in flight was not completed: {exc!r}")


def _quiet_dcp() -> None:
    """Silence DCP's warning whenever a process without a group saves or loads, even when
    told to (a run on one rank: intended); the saving thread's warnings escape a
    catch_warnings block, so the filter is process-wide."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")


def _write_sums(folder: Path) -> None:
    lines = [f"{_sha256(p)}  {p.name}\n" for p in sorted(folder.iterdir()) if p.name != SUMS]
    atomic_save_text(folder / SUMS, "".join(lines))


def atomic_save_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file, fsync and rename."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _prune(directory: Path, kept: set[str]) -> None:
    """Delete all checkpoints but those named in `kept`, and interrupted writes."""
    for old in directory.iterdir():
        stale = _PATTERN.match(old.name) or old.name.endswith(".tmp")
        if stale and old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)


def verify(folder: Path) -> str | None:
    """Why the checkpoint `folder` cannot be trusted (a file missing or not matching its
    recorded sha256), or None when every file listed in its SHA256SUMS matches."""
    sums = folder / SUMS
    if not sums.is_file():
        return f"has no {SUMS} (an interrupted write)"
    for line in sums.read_text().splitlines():
        recorded, _, name = line.partition("  ")
        path = folder / name
        if not path.is_file():
            return f"lacks {name}"
        if _sha256(path) != recorded:
            size = path.stat().st_size
            return f"{name} does not match its recorded sha256 ({size} bytes: damaged)"
    if not (folder / ".metadata").is_file() or not (folder / TRAIN_STATE).is_file():
        return "lacks .metadata or train_state.pt"
    return None


def find_resumable(directory: Path, sharded: bool, ctx: DistContext) -> Resumable | None:
    """The checkpoint a job resumes from: resumable_sharded (fsdp) or the whole-state
    resumable_checkpoint (ddp). ConfigError when `directory` holds the other strategy's
    checkpoints: a run cannot change its strategy, and starting afresh would hide its
    progress."""
    other = checkpoints(directory) if sharded else sharded_checkpoints(directory)
    if other:
        was, now = ("ddp", "fsdp") if sharded else ("fsdp", "ddp")
        raise ConfigError(
            f"{directory} holds checkpoints of a train.strategy={was} run ({other[0].name}), "
            f"which a train.strategy={now} run cannot resume: use train.strategy={was}, start "
            f"a new run (it trains in a folder of its own), or delete {directory} to start "
            "this run from scratch"
        )
    return resumable_sharded(directory, ctx) if sharded else resumable_checkpoint(directory)


def resumable_sharded(directory: Path, ctx: DistContext) -> Resumable | None:
    """The newest checkpoint folder of directory that verifies, with its train state (every
    rank gets rank 0's choice). None when there is none; DataError when none verifies."""
    choice: list[Any] = [None]
    if ctx.is_main:
        choice[0] = _choose(directory)
    if ctx.world_size > 1:
        dist.broadcast_object_list(choice, src=0)
    found = choice[0]
    if isinstance(found, str):
        raise DataError(found)
    if found is None:
        return None
    path, skipped = found
    return Resumable(Path(path), load_state(Path(path) / TRAIN_STATE), skipped)


def _choose(directory: Path) -> tuple[str, list[str]] | str | None:
    """(newest verifying folder, lines on the newer ones skipped); the DataError message
    when none verifies; None when there is no checkpoint."""
    skipped: list[str] = []
    for folder in sharded_checkpoints(directory):
        problem = verify(folder)
        if problem is None:
            return str(folder), skipped
        skipped.append(f"{folder} {problem}")
    if skipped:
        return (
            "no checkpoint to resume from verifies: " + "; ".join(skipped) + ". Restore one, "
            f"or delete {directory} to start this run from scratch"
        )
    return None


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Fill `model` and `optimizer` (sharded over this job's ranks, however many) from the
    checkpoint `folder`, whatever number of ranks wrote it (collective), and whatever pipeline
    stages (see flat_optimizer)."""
    import torch.distributed.checkpoint as dcp  # (see _dcp_state)

    sd = _dcp_state()
    options = sd.StateDictOptions(flatten_optimizer_state_dict=flat_optimizer(folder))
    # the shards to fill
    model_state, optim_state = sd.get_state_dict(model, optimizer, options=options)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    _quiet_dcp()
    dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())  # fills in place
    sd.set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=options,
    )


def flat_optimizer(folder: Path) -> bool:
    """Whether the checkpoint `folder` holds the optimizer's state flattened, each parameter
    group's settings stored per parameter name (`optimizer.param_groups.<name>.lr`), as they
    are written: a pipeline stage holds its own parameters' groups, and the groups of every
    stage must be kept (torchtitan's flatten_optimizer_state_dict). Checkpoints written
    before kept one list of groups (`optimizer.param_groups`), and still load."""
    import torch.distributed.checkpoint as dcp  # (see _dcp_state)

    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return "optimizer.param_groups.0.params" not in keys  # the list's: unflattened


def full_weights(model: nn.Module, ctx: DistContext | None = None) -> dict[str, Any]:
    """The whole model's state dict, gathered onto rank 0's host memory (collective: every
    rank calls it; the others get {}). What best.pt and the logged MLflow model hold, so they
    load into a plain model as a DDP run's do. Under pipeline stages (ctx.pp above 1) `model`
    is this rank's stage: each stage's is gathered whole onto its first rank, and those are
    sent to rank 0."""
    sd = _dcp_state()
    if ctx is None or ctx.pp == 1:
        options = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return sd.get_model_state_dict(model, options=options)
    whole = sd.get_model_state_dict(model, options=sd.StateDictOptions(full_state_dict=True))
    first = ctx.rank % (ctx.world_size // ctx.pp) == 0  # the stage's first rank
    mine = {k: v.detach().to("cpu", copy=True) for k, v in whole.items()} if first else {}
    del whole
    stages: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(mine, stages, dst=0)
    return {k: v for stage in stages or [] for k, v in stage.items()}


def _dcp_state() -> Any:
    """torch.distributed.checkpoint.state_dict, imported on first use: DCP imports DTensor and
    sympy (~0.6 s), which a DDP run (and the flow process, which imports this module with the
    training job) never needs."""
    import torch.distributed.checkpoint.state_dict as state_dict

    return state_dict
