"""Naming a rank that is persistently slower than the others (a straggler), on rank 0.

Every window of steps, rank 0 gets each rank's seconds of data wait, compute and communication
(tasks.train.limits.step_times). A rank's own time a step is its data wait plus its compute: the
communication part is mostly waiting for the slowest rank (under DDP every step waits for all
gradients), so a long one marks a rank held back by a peer, not a slow rank. A rank whose own
time exceeds the median of the other ranks' by more than ``train.straggler_fraction`` is
slow in that window; slow in ``train.straggler_windows`` windows in a row, it is named: one
warning line in the job's log (forwarded to the command's output) and the train run's tag
``trainflow.straggler``, both saying the rank, its node and the part (data wait or compute)
that exceeds the other ranks' median the most. A rank that recovers and is slow again is
named again.

Under FSDP the parameter gathers and gradient reductions run inside the forward and backward
passes, so a rank waiting for a late peer does it in what counts as its compute: every rank's
compute takes as long as the slowest one's, and only the data wait can tell ranks apart. There
a rank is slow when its data wait exceeds the other ranks' median data wait by more than
``train.straggler_fraction`` of their median step (data wait + compute); a rank slow in its
compute is not found (FSDP_NOTE says so in the job's log).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from trainflow.console import say
from trainflow.tasks.tracking.journal import Journal
from trainflow.tasks.tracking.logger import tag_run
from trainflow.tasks.tracking.system_metrics import node_name
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.limits.step_times import StepTimes

TAG = "trainflow.straggler"
"""The train run's tag naming the stragglers found."""
_LABELS = ("data wait", "compute")
FSDP_NOTE = (
    "under train.strategy=fsdp a straggler is named by its data wait only: FSDP's collectives "
    "wait for slower ranks inside the forward and backward passes, where waiting cannot be "
    "told from compute; each rank's step time is logged (rank_step_s/rank_<r>)"
)


@dataclass(frozen=True)
class Slow:
    """A rank slower than the median rank in one window."""

    rank: int
    """The slow rank."""
    own_s: float
    """Its data wait + compute a step, seconds."""
    median_own_s: float
    """The median of the other ranks'."""
    part: str
    """'data wait' or 'compute': the part above its median by the most seconds a step."""
    part_s: float
    """That part a step on this rank, seconds."""
    median_part_s: float
    """The median of that part a step on the other ranks, seconds."""
    data_only: bool = False
    """Judged on its data wait alone (slow_in_data: FSDP)."""


def slow_ranks(rows: list[list[float]], fraction: float) -> list[Slow]:
    """The ranks whose own time a step exceeds the median of the other ranks' by more than
    `fraction`, from every rank's row [data_wait, compute, comm, steps] (seconds summed over the
    window). Against the others, not all: with 2 ranks each is compared with its peer."""
    if len(rows) < 2:
        return []
    per_step = [[data / max(n, 1), compute / max(n, 1)] for data, compute, _, n in rows]
    own = [data + compute for data, compute in per_step]
    others = medians_of_others(own)
    parts = [medians_of_others([r[i] for r in per_step]) for i in range(2)]
    found = []
    for rank, seconds in enumerate(own):
        if seconds > (1 + fraction) * others[rank]:
            excess = [per_step[rank][i] - parts[i][rank] for i in range(2)]
            i = excess.index(max(excess))
            found.append(
                Slow(rank, seconds, others[rank], _LABELS[i], per_step[rank][i], parts[i][rank])
            )
    return found


def slow_in_data(rows: list[list[float]], fraction: float) -> list[Slow]:
    """The ranks whose data wait a step exceeds the median of the other ranks' by more than
    `fraction` of the other ranks' median step (data wait + compute), from the same rows as
    slow_ranks: the rule for FSDP, where a rank's compute includes waiting for its peers."""
    if len(rows) < 2:
        return []
    data = [d / max(n, 1) for d, _, _, n in rows]
    own = [(d + c) / max(n, 1) for d, c, _, n in rows]
    data_others, own_others = medians_of_others(data), medians_of_others(own)
    return [
        Slow(rank, own[rank], own_others[rank], "data wait", d, data_others[rank], True)
        for rank, d in enumerate(data)
        if d - data_others[rank] > fraction * own_others[rank]
    ]


def medians_of_others(values: list[float]) -> list[float]:
    """For each index, the median of all the other values (at least 2 values): one sort."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ordered = [values[i] for i in order]
    place = {index: k for k, index in enumerate(order)}
    m = len(values) - 1  # values left when one is taken out

    def nth(j: int, k: int) -> float:  # the j-th smallest once the k-th smallest is out
        return ordered[j if j < k else j + 1]

    result = []
    for index in range(len(values)):
        k = place[index]
        if m % 2:
            result.append(nth(m // 2, k))
        else:
            result.append((nth(m // 2 - 1, k) + nth(m // 2, k)) / 2)
    return result


def describe(slow: Slow, node: str) -> str:
    """`rank 1 on node n2: data wait 12.0x median (31.2 ms a step against 2.6 ms)`."""
    ms, median_ms = 1000 * slow.part_s, 1000 * slow.median_part_s
    ratio = f"{slow.part_s / slow.median_part_s:.1f}x median" if median_ms >= 0.05 else "slow"
    return (
        f"rank {slow.rank} on node {node}: {slow.part} {ratio} "
        f"({ms:.1f} ms a step against {median_ms:.1f} ms)"
    )


class StragglerWatch:
    """Rank 0's judge of every window (see the module docstring); a step_times.Judge."""

    def __init__(
        self,
        fraction: float,
        windows: int,
        window_steps: int,
        nodes: list[str],
        journal: Journal | None,
        say: Callable[[str], None] = say,
        judge: Callable[[list[list[float]], float], list[Slow]] = slow_ranks,
    ) -> None:
        self._fraction, self._windows, self._window_steps = fraction, windows, window_steps
        self._judge = judge
        self._nodes, self._journal, self._say = nodes, journal, say
        self._streak: dict[int, int] = {}
        self.named: dict[int, str] = {}
        """The description of every rank named so far (the latest per rank)."""

    def __call__(self, rows: list[list[float]], step: int) -> None:
        """Judge one window of every rank's [data_wait, compute, comm, steps] ending at `step`."""
        slow = {s.rank: s for s in self._judge(rows, self._fraction)}
        self._streak = {rank: self._streak.get(rank, 0) + 1 for rank in slow}
        for rank, s in slow.items():
            if self._streak[rank] == self._windows:
                self._name(s, step)

    def _name(self, slow: Slow, step: int) -> None:
        text = describe(slow, self._nodes[slow.rank])
        self.named[slow.rank] = text
        span = f"over the last {self._windows * self._window_steps} steps (to step {step})"
        if slow.data_only:
            extra = slow.part_s - slow.median_part_s
            share = extra / max(slow.median_own_s, 1e-9)
            why = (
                f"its data wait exceeds the other ranks' median by {1000 * extra:.1f} ms a "
                f"step, {share:.0%} of their step"
            )
        else:
            ratio = slow.own_s / max(slow.median_own_s, 1e-9)
            why = (
                f"its data wait + compute, {1000 * slow.own_s:.1f} ms a step, is {ratio:.1f}x "
                "the median of the other ranks'"
            )
        self._say(f"warning: straggler {text}; {why} {span}")
        tag_run(self._journal, {TAG: "; ".join(self.named[r] for r in sorted(self.named))})


def rank_nodes(ctx: DistContext, node: str) -> list[str]:
    """Every rank's node name (one all_gather_object, once a job)."""
    if ctx.world_size == 1:
        return [node]
    nodes: list[str] = [""] * ctx.world_size
    dist.all_gather_object(nodes, node)
    return nodes


def step_timer(
    cfg: TrainConfig, model: nn.Module, ctx: DistContext, journal: Journal | None
) -> StepTimes:
    """This rank's step timer; with several ranks and train.straggler_fraction > 0 it closes a
    window every train.straggler_window_steps steps, judged on rank 0 by a StragglerWatch (by
    the data wait alone under FSDP, which rank 0 says: FSDP_NOTE)."""
    if ctx.world_size == 1 or cfg.straggler_fraction == 0:
        return StepTimes(model, ctx, cfg.straggler_window_steps, None)
    fsdp = cfg.strategy == "fsdp"
    if fsdp and ctx.is_main:
        say(FSDP_NOTE)
    nodes = rank_nodes(ctx, node_name())
    watch = StragglerWatch(
        cfg.straggler_fraction,
        cfg.straggler_windows,
        cfg.straggler_window_steps,
        nodes,
        journal,
        judge=slow_in_data if fsdp else slow_ranks,
    )
    return StepTimes(model, ctx, cfg.straggler_window_steps, watch)
