"""Where each rank's training steps spend their time: data wait, compute and communication.

Every step is split on the rank's own clock (``time.perf_counter``, a few calls a step):

- data wait: the time the loop waits for its next batch (``next()`` of the split's batches).
- communication: under DDP, from the moment this rank's backward pass has computed its last
  gradient (one ``torch.autograd.graph.register_multi_grad_hook`` over the parameters, called
  once a step) until ``backward()`` returns: DDP all-reduces gradient buckets while the
  backward runs and waits for the last ones at its end, so this is the all-reduce not hidden
  behind computation, including the time spent waiting for slower ranks to send theirs (a
  fast rank waits, a slow rank hardly does). Plus the start of DDP's forward up to the wrapped
  model's (a forward pre-hook, the first of the model's): DDP broadcasts rank 0's buffers
  there (batch norm statistics). NVIDIA's straggler detector and SPDL's straggler guide read
  a collective's time the same way (the waiting ranks are the victims, not the cause).
  Under FSDP and on one rank it is 0: FSDP's all-gathers and reduce-scatters, and the waits
  for slower ranks in them, run inside the forward and backward passes and count as compute
  (a data-slow rank's peers then show as compute-slow as it is: under FSDP a straggler is
  judged by its data wait alone, tasks.train.limits.stragglers).
- compute: the rest of the step (forward, backward, optimizer) minus communication.

On a GPU these are host times (the host queues kernels ahead of the device and waits where it
syncs); the window's end synchronises the device, so the window's total is the device's.

Every ``window_steps`` steps (a step count all ranks share) the window's sums of every rank are
gathered into rank 0 (one all-gather of four floats) and handed to a judge
(tasks.train.limits.stragglers); the epoch's sums go to the epoch's metrics
(tasks.train.throughput).
"""

import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from trainflow.tasks.train.distributed import DistContext

PARTS = ("data_wait", "compute", "comm")
"""The parts of a step, in the order of every row of seconds."""

Judge = Callable[[list[list[float]], int], None]
"""Told, on rank 0, every rank's window row [data_wait, compute, comm, steps] and the step."""


class StepTimer(Protocol):
    """What the training loop tells about each step."""

    def data(self) -> None:
        """The loop starts waiting for its next batch."""

    def step(self) -> None:
        """The batch is here; the step starts."""

    def done(self, step: int) -> None:
        """The step is done; `step` steps are done in the run."""

    def take_epoch(self) -> list[float]:
        """The epoch's seconds [data_wait, compute, comm]; the next epoch's start at 0."""
        ...


class NoTimer:
    """Times nothing (the default of a Trainer built outside a training job)."""

    def data(self) -> None:
        """Nothing to mark."""

    def step(self) -> None:
        """Nothing to mark."""

    def done(self, step: int) -> None:
        """Nothing to add."""

    def take_epoch(self) -> list[float]:
        """Nothing measured: zeros."""
        return [0.0, 0.0, 0.0]


NO_TIMER = NoTimer()


class StepTimes:
    """This rank's step timer (see the module docstring); `judge` gets every window on rank 0,
    None: no window gathers (the epoch's sums are still kept)."""

    def __init__(
        self, model: nn.Module, ctx: DistContext, window_steps: int, judge: Judge | None
    ) -> None:
        self._ctx, self._window, self._judge = ctx, window_steps, judge
        self._t_data = self._t_step = self._t_grads = self._t_forward = 0.0
        self.epoch = [0.0, 0.0, 0.0]
        """This epoch's seconds [data_wait, compute, comm]; reset by take_epoch()."""
        self._sums = [0.0, 0.0, 0.0, 0.0]  # the window's, and its step count
        self._hooks: list[RemovableHandle] = []
        if isinstance(model, DistributedDataParallel):
            params = [p for p in model.module.parameters() if p.requires_grad]
            grads = torch.autograd.graph.register_multi_grad_hook(
                params, self._grads_done, mode="all"
            )
            # First of its pre-hooks: the time in the others (a user's) is compute.
            forward = model.module.register_forward_pre_hook(self._forward_starts, prepend=True)
            self._hooks = [grads, forward]

    def close(self) -> None:
        """Remove the hooks from the model (it then runs as if never timed)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _grads_done(self, grads: object) -> None:
        """Called once a backward pass has computed every parameter's gradient."""
        self._t_grads = time.perf_counter()

    def _forward_starts(self, module: nn.Module, args: object) -> None:
        """Called as the wrapped model's forward starts, after DDP's buffer broadcast."""
        if module.training:
            self._t_forward = time.perf_counter()

    def data(self) -> None:
        """Mark the start of the wait for a batch."""
        self._t_data = time.perf_counter()

    def step(self) -> None:
        """Mark the batch's arrival: the step starts."""
        self._t_step = time.perf_counter()

    def done(self, step: int) -> None:
        """Add the step's parts to the epoch and the window; close the window when due."""
        now = time.perf_counter()
        data = self._t_step - self._t_data
        # A step whose hooks did not fire (no gradient) has no measured communication.
        comm = now - self._t_grads if self._t_grads > self._t_step else 0.0
        comm += self._t_forward - self._t_step if self._t_forward > self._t_step else 0.0
        parts = (data, now - self._t_step - comm, comm)
        for i, seconds in enumerate(parts):
            self.epoch[i] += seconds
            self._sums[i] += seconds
        self._sums[3] += 1
        if self._judge is not None and step % self._window == 0:
            self._close_window(step)

    def take_epoch(self) -> list[float]:
        """The epoch's [data_wait, compute, comm] seconds; starts the next epoch's at 0."""
        taken, self.epoch = self.epoch, [0.0, 0.0, 0.0]
        return taken

    def _close_window(self, step: int) -> None:
        """Gather every rank's window into rank 0 and judge it there (a collective)."""
        if self._ctx.device.type == "cuda":
            torch.cuda.synchronize(self._ctx.device)
        rows = gather_rows(self._sums, self._ctx)
        self._sums = [0.0, 0.0, 0.0, 0.0]
        if self._judge is not None and self._ctx.is_main:
            self._judge(rows, step)


def gather_rows(row: list[float], ctx: DistContext) -> list[list[float]]:
    """Every rank's `row` (the same length on all), on every rank; one all-gather."""
    mine = torch.tensor(row, dtype=torch.float64, device=ctx.device)
    if ctx.world_size == 1:
        return [row]
    rows = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]
