"""Distributed set-up and tear-down: who am I (rank), which device, which backend.

Under submitit the rank layout comes from the job environment and the ranks meet on a store
rank 0 starts on a free port of the first node (tasks.train.rendezvous); under torchrun the
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables are already set and torch's env://
rendezvous reads them; a plain process is a world of one with no process group at all.
"""

import atexit
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import submitit
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainflow.errors import ConfigError
from trainflow.tasks.train.limits.early_signal import in_submitit_task
from trainflow.tasks.train.rendezvous import Layout, export_env, meet, submitit_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long a collective waits for a silent peer before the job fails instead of hanging,
unless the job's environment sets PEER_TIMEOUT_ENV (cluster.peer_timeout_s does)."""
PEER_TIMEOUT_ENV = "TRAINFLOW_PEER_TIMEOUT_S"


def peer_timeout() -> timedelta:
    """The collective timeout: PEER_TIMEOUT_ENV seconds when set (by cluster.rank_guard from
    cluster.peer_timeout_s), else DEFAULT_TIMEOUT."""
    value = os.environ.get(PEER_TIMEOUT_ENV, "")
    return timedelta(seconds=int(value)) if value.isdigit() else DEFAULT_TIMEOUT


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes training together."""
    local_rank: int
    """Rank on this node: picks the GPU."""
    device: torch.device
    """The device this rank trains on."""
    backend: str | None
    """'gloo' or 'nccl'; None when world_size is 1 (no process group)."""
    tp: int = 1
    """Ranks of a tensor-parallel group (train.parallel.tp): they take the same batches."""
    pp: int = 1
    """Pipeline stages (train.parallel.pp): the stages of one pipeline take the same batches."""
    dp_group: dist.ProcessGroup | None = None
    """The ranks sharing this rank's tensor-parallel coordinate (every stage's: only the last
    stage of a pipeline counts its samples, the others add zeros), over which metric sums are
    all-reduced (tasks.train.parallel.mesh); None: all ranks."""
    mesh: "DeviceMesh | None" = None
    """The job's device mesh (train.strategy=fsdp on several ranks); None otherwise."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank with side effects (logs, checkpoints, results)."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: which batches it takes (its place in the mesh
        without its tensor-parallel and pipeline coordinates: tp innermost, pp outermost)."""
        return (self.rank // self.tp) % self.dp_size

    @property
    def mesh_text(self) -> str:
        """The mesh's sizes ('dp_shard=2 x tp=2') when it is more than FSDP's one dimension of
        all ranks; '' otherwise."""
        names = tuple(self.mesh.mesh_dim_names or ()) if self.mesh is not None else ()
        if self.mesh is None or names == ("dp_shard",):
            return ""
        return " x ".join(f"{n}={s}" for n, s in zip(names, self.mesh.shape, strict=True))

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many take batches of their own (the world size without
        tensor parallelism and pipeline stages)."""
        return self.world_size // (self.tp * self.pp)


def _export_submitit_env() -> Layout | None:
    """Export a multi-task submitit job's rank layout as torch's RANK / WORLD_SIZE / LOCAL_RANK
    variables and return it; None (nothing exported) outside such a job.

    CUDA_VISIBLE_DEVICES stays as the scheduler set it (submitit's own helper rewrites it to
    the local rank, which hides the GPU when Slurm already bound one per task)."""
    layout = submitit_layout()
    if layout is not None:
        export_env(layout)
    return layout


def _pick_device(device_pref: str, local_rank: int) -> torch.device:
    """cuda:<local rank> for auto/cuda when CUDA is usable, else cpu."""
    if device_pref == "cpu" or (device_pref == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "train.device=cuda but this process sees no usable GPU: set train.device=auto or cpu, "
            "or request GPUs (cluster.gpus_per_node)"
        )
    count = torch.cuda.device_count()
    # One visible GPU means the scheduler bound this rank to it.
    index = 0 if count == 1 else local_rank
    if index >= count:
        raise ConfigError(f"local rank {local_rank} has no GPU: only {count} are visible")
    return torch.device("cuda", index)


def setup_distributed(device_pref: str, timeout: timedelta | None = None) -> DistContext:
    """Read the rank layout, pick the device and join the process group (when world > 1).

    `timeout` (default: peer_timeout()) bounds every collective's wait for a silent peer."""
    timeout = timeout or peer_timeout()
    layout = _export_submitit_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(device_pref, local_rank)
    if world_size == 1:
        return DistContext(rank, 1, local_rank, device, None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = None
    if layout is not None:
        store = meet(layout, timeout)
        export_env(layout, store.port)  # MASTER_PORT as it is, for code that reads it
    dist.init_process_group(
        backend,
        store=store,
        timeout=timeout,
        rank=rank,
        world_size=world_size,
        device_id=device if device.type == "cuda" else None,
    )
    return DistContext(rank, world_size, local_rank, device, backend)


def teardown() -> None:
    """Leave the process group if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def distributed(device_pref: str, timeout: timedelta | None = None) -> Iterator[DistContext]:
    """setup_distributed() paired with teardown(), also when the body raises.

    On an exception this rank leaves the group and the exception propagates, so the process
    exits non-zero; its peers' next collective then fails on the closed connection (gloo) or
    after `timeout` (nccl) instead of waiting forever.

    A requested exit (SystemExit: submitit's requeue on timeout or preemption) leaves the
    process right after the group, skipping interpreter shutdown: there, objects still
    holding a gloo group whose peer is alive can abort the process (SIGABRT, seen about
    once in ten requeues), and a requeue exit code turned into an abort is a failed job.
    """
    ctx = setup_distributed(device_pref, timeout)
    try:
        yield ctx
    except SystemExit as request:
        if ctx.world_size > 1:
            teardown()
            _exit_now(request.code)
        raise
    finally:
        teardown()


def _exit_now(code: object) -> None:
    """Flush what the process printed or logged, then end it with `code` at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


_KEPT: list[object] = []
"""Objects whose destructors must not run before a fast exit (see exit_fast_at_shutdown)."""


def exit_fast_at_shutdown(*keep: object) -> None:
    """In a submitit task process (local or Slurm), skip the interpreter's teardown at exit.

    Tearing down torch's ~2000 modules takes 0.9 s on an idle 2-core machine (2.5 s loaded)
    after the result is written, and a job ends only when all its ranks have exited. Call
    once training succeeded: submitit then writes the result and its log lines as usual,
    and at exit this handler, run before every other, flushes and leaves at once.
    """
    if _is_submitit_task_process():
        # `keep` (the DDP model) stays referenced until then: freed when the training function
        # returns, its Reducer drops the last reference to the gloo process group, whose
        # destructor joins gloo's worker threads while holding the GIL; a worker still
        # releasing its last all-reduce needs the GIL, and the rank hangs for good (seen as a
        # rank 1 that never exited after rank 0 finished; py-spy showed both threads).
        _KEPT.extend(keep)
        atexit.register(_exit_at_shutdown)


def release_kept() -> None:
    """Drop what exit_fast_at_shutdown kept (a finished training's model and optimizer) and
    collect it, in a process that trains again (a search task's next trial): trials' models
    would otherwise pile up in memory. Safe then: the kept training's process group was
    destroyed long before and its gloo threads are idle, so its destructor joins them at once
    (the hang above needs a thread still finishing that group's last all-reduce)."""
    import gc

    _KEPT.clear()
    gc.collect()


def _is_submitit_task_process() -> bool:
    """True only in a process submitit started to run a task: never in the caller's process
    (the debug executor, tests, a flow that runs inside a Slurm allocation)."""
    if not in_submitit_task():
        return False
    try:
        return submitit.JobEnvironment().cluster in ("local", "slurm")
    except RuntimeError:
        return False


def _exit_at_shutdown() -> None:
    # An exception that escaped after training (e.g. a result that cannot be pickled) left
    # sys.last_value behind: keep the failing exit code then.
    _exit_now(1 if hasattr(sys, "last_value") else 0)


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum `tensor` over the data-parallel ranks and pipeline stages in place (all ranks
    without tensor parallelism; no-op when there is one) and return it: a tensor-parallel
    group's ranks hold sums of the same samples; of a pipeline's stages only the last has
    outputs, and the others hold zeros."""
    if ctx.world_size // ctx.tp > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=ctx.dp_group)
    return tensor


def wrap_ddp(
    model: nn.Module, ctx: DistContext, bucket_cap_mb: float = 25.0, accumulation: int = 1
) -> nn.Module:
    """`model` wrapped in DistributedDataParallel when the world has several ranks.

    - gradient_as_bucket_view: gradients are views into DDP's all-reduce buckets, which saves
      one copy of every gradient per step and that much memory.
    - bucket_cap_mb: the size cap of those buckets (TrainConfig.ddp_bucket_cap_mb).
    - static_graph: our models use every parameter in every step, in the same graph, so DDP
      may learn the bucket order once and skip its per-step search for unused parameters.
      Checkpoints are unaffected (they save the unwrapped module), and torch.compile works
      with it (torch tests DDP + compile + static_graph since 2.2). Not with gradient
      `accumulation` (several micro-batches per step): those skip the all-reduce in all but
      the last micro-batch (gradient_sync: DDP's no_sync), and a static graph's first
      backward inside no_sync fails an internal assert in torch 2.13 (pytorch#143580; its
      open fix, pytorch#187732, found that past the assert later steps would skip their
      all-reduce). bench/p13_accumulation.py measures what each saves.
    """
    if ctx.world_size == 1:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(
        model,
        device_ids=ids,
        gradient_as_bucket_view=True,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=accumulation == 1,
    )


def gradient_sync(model: nn.Module, last: bool) -> AbstractContextManager[object]:
    """Where a micro-batch's forward and backward run: under DDP's no_sync unless it is the
    step's `last` (its gradients then add up locally, and the last backward all-reduces the
    sum once). FSDP (fully_shard) reduce-scatters every micro-batch's gradients into the
    sharded ones: its set_requires_gradient_sync(False) would keep every parameter's
    unsharded gradient on every rank between micro-batches, the memory fsdp is chosen to
    save (torchtitan makes the same choice)."""
    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return nullcontext()
