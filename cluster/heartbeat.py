"""A rank's progress, told to its guard (cluster.rank_guard), and the stacks of a hung rank.

The guard gives each rank two paths in its environment: ``TRAINFLOW_HEARTBEAT``
(``<job id>_<task>_beat`` beside submitit's files) and ``TRAINFLOW_STACKS``
(``<job id>_<task>_stacks.txt``). The training job (tasks.train.job) maps the first into memory
and writes one fixed-size record (33 bytes) into it at every beat: a count, the wall time, the
step, the phase (PHASES) and how long the rank may stay silent in that phase. A beat is a
`struct.pack_into` into shared memory, no system call (three a step: about 1.4 us), so the
step loop beats at every phase change. The guard, on the rank's node, reads the file every
second through the same page cache: while its bytes change the rank makes progress; once they
have not changed for longer than the allowance the record carries, the rank is hung (a torn
read only ever looks like progress).

A rank with no heartbeat file (any function other than the training job, or
train.hang_timeout_s=0) is never judged.

Stacks: cluster.rank_main registers `faulthandler` on STACK_SIGNAL (SIGUSR1: submitit uses
SIGUSR2 and SIGTERM, NCCL none), all threads, into the stacks file; the guard of a hung rank
sends it, copies the dump into the rank's log and names the stuck frame (`stuck_frame`).
"""

import mmap
import os
import re
import signal
import struct
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

BEAT_ENV = "TRAINFLOW_HEARTBEAT"
"""Environment variable: the path of this rank's heartbeat file (set by the guard)."""
STACKS_ENV = "TRAINFLOW_STACKS"
"""Environment variable: where this rank's faulthandler writes its stacks (set by the guard)."""
STACK_SIGNAL = signal.SIGUSR1
"""The signal that makes a rank dump the stacks of all its threads."""
PHASES = ("start-up", "data", "step", "backward", "evaluation", "checkpoint", "shut-down")
"""What a rank can be doing; the record keeps the index. data: fetching a batch; step: the
forward pass and loss; backward: the backward pass with its gradient all-reduce, and the
optimizer step."""
_INDEX = {phase: index for index, phase in enumerate(PHASES)}
_ORDER = {"start-up": 0, "evaluation": 1, "checkpoint": 2, "data": 3, "step": 4, "backward": 5}
"""The order of the phases at one step count: an epoch's evaluation and checkpoint come after
its last step, before the next epoch's first batch."""
CHECKPOINT_FACTOR = 4.0
"""A checkpoint phase may take this many times the longest one measured so far in the rank."""
RECORD = struct.Struct("<QdqBd")
"""count, wall time of the beat, step, phase index, allowance (s)."""


@dataclass(frozen=True)
class Beat:
    """One heartbeat record."""

    count: int
    """Beats so far."""
    at: float
    """Wall time (time.time()) of the beat."""
    step: int
    """Optimiser steps done when it beat."""
    phase: str
    """One of PHASES."""
    allowed_s: float
    """How long the rank may make no progress in this phase."""


def position(beat: "Beat") -> tuple[int, int]:
    """How far a rank has come, comparable between the ranks of a job: (steps, phase)."""
    return beat.step, _ORDER.get(beat.phase, len(_ORDER))


def read_beat(path: Path) -> Beat | None:
    """The record in a heartbeat file; None when there is none (yet) or it does not decode."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    return decode(raw)


def decode(raw: bytes) -> Beat | None:
    """A heartbeat record from a file's bytes, None when they hold none."""
    if len(raw) < RECORD.size:
        return None
    count, at, step, phase, allowed = RECORD.unpack_from(raw)
    if count == 0 or phase >= len(PHASES) or not allowed > 0:
        return None
    return Beat(count, at, step, PHASES[phase], allowed)


class Heartbeat:
    """The rank's side: `beat(phase, step)` wherever it makes progress.

    Allowances: `first_s` (at least `timeout_s`) for start-up and for the first time through
    each phase (compilation, loading, the first save); then `timeout_s`, and for a checkpoint
    the larger of `timeout_s` and CHECKPOINT_FACTOR times the longest checkpoint phase measured
    so far. Without a path, or with timeout_s=0, every beat does nothing.
    """

    def __init__(self, path: Path | None, timeout_s: float, first_s: float) -> None:
        self.timeout_s = timeout_s
        self.first_s = max(first_s, timeout_s)
        self._mm: mmap.mmap | None = None
        self._count = 0
        self._step = 0
        self._phase = -1
        self._entered = 0.0
        self._allowed = self.first_s
        self._seen: set[int] = set()
        self._warm: set[int] = set()
        self._longest_checkpoint = 0.0
        if path is None or timeout_s <= 0:
            return
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, RECORD.size)
            self._mm = mmap.mmap(fd, RECORD.size)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    @classmethod
    def from_env(cls, timeout_s: float, first_s: float) -> "Heartbeat":
        """The heartbeat the guard asked for in the environment (none outside a guard)."""
        path = os.environ.get(BEAT_ENV)
        return cls(Path(path) if path else None, timeout_s, first_s)

    def beat(self, phase: str, step: int | None = None) -> None:
        """Progress in `phase` (one of PHASES) at `step` (None: the last step given)."""
        mm = self._mm
        if mm is None:
            return
        index = _INDEX[phase]
        if step is not None:
            self._step = step
        if index != self._phase:
            self._enter(index)
        elif index not in self._warm and index != 0:
            self._warm.add(index)  # a second beat in a row: the first unit of it is done
            self._allowed = self._allowance(index)
        self._count += 1
        RECORD.pack_into(mm, 0, self._count, time.time(), self._step, index, self._allowed)

    def _enter(self, index: int) -> None:
        now = time.monotonic()
        if self._phase == _INDEX["checkpoint"]:
            self._longest_checkpoint = max(self._longest_checkpoint, now - self._entered)
            self._warm.add(self._phase)
        if index in self._seen:
            self._warm.add(index)
        self._seen.add(index)
        self._phase, self._entered = index, now
        self._allowed = self._allowance(index)

    def _allowance(self, index: int) -> float:
        if index not in self._warm:
            return self.first_s
        if PHASES[index] == "checkpoint":
            return max(self.timeout_s, CHECKPOINT_FACTOR * self._longest_checkpoint)
        return self.timeout_s

    def close(self) -> None:
        """Stop beating (the file stays with its last record)."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None


NO_HEARTBEAT = Heartbeat(None, 0.0, 0.0)
"""A heartbeat that does nothing."""

_stacks_file: IO[str] | None = None


def install_stack_dump() -> None:
    """In a rank: dump all threads' stacks into TRAINFLOW_STACKS (else stderr) on STACK_SIGNAL."""
    import faulthandler
    import sys

    global _stacks_file
    path = os.environ.get(STACKS_ENV)
    target: IO[str] = sys.stderr
    if path:
        _stacks_file = open(path, "w")  # noqa: SIM115 - kept open for the handler
        target = _stacks_file
    faulthandler.register(STACK_SIGNAL, file=target, all_threads=True, chain=False)


_FRAME = re.compile(r'\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)')


def _library(path: str) -> bool:
    """Whether `path` is Python's or an installed package's code (not trainflow's, not the
    user's)."""
    if path.startswith("<"):
        return True
    if re.search(r"/(site|dist)-packages/", path):
        return not re.search(r"/(site|dist)-packages/trainflow/", path)
    stdlib = sysconfig.get_paths()["stdlib"]
    return path.startswith(stdlib.rstrip("/") + "/")


def short_path(path: str) -> str:
    """trainflow's and installed packages' files from the package's folder on
    (trainflow/tasks/train/loop.py, torch/distributed/distributed_c10d.py)."""
    installed = re.search(r"/(site|dist)-packages/", path)
    if installed:
        return path[installed.end() :]
    at = path.rfind("/trainflow/")
    return path[at + 1 :] if at >= 0 else path


def _main_frames(dump: str) -> list[re.Match[str]]:
    """The frames of the main thread in a faulthandler dump (listed last), innermost first."""
    blocks = [b for b in re.split(r"\n\s*\n", dump.strip()) if "(most recent call first)" in b]
    return [m for m in map(_FRAME.match, blocks[-1].splitlines()) if m] if blocks else []


def in_collective(dump: str) -> bool:
    """Whether the main thread's innermost frame is torch.distributed's (a collective); frames
    of torch's op dispatcher (torch/_ops.py) inside it do not count: a functional collective
    (DTensor's, under tensor parallelism) waits through `torch.ops._c10d_functional`."""
    frames = [m for m in _main_frames(dump) if not m["file"].endswith("/torch/_ops.py")]
    return bool(frames) and "/torch/distributed/" in frames[0]["file"]


def stuck_frame(dump: str) -> str | None:
    """The frame a hung rank is stuck in, from a faulthandler dump of all threads: in the main
    thread (faulthandler lists it last), the innermost frame of trainflow's or the user's code
    ('trainflow/tasks/train/loop.py:123 in train_epoch'), followed by the innermost frame when
    that is a library's ('... (in torch/.../distributed_c10d.py:2501 in all_reduce)')."""
    frames = _main_frames(dump)
    if not frames:
        return None

    def name(m: re.Match[str]) -> str:
        return f"{short_path(m['file'])}:{m['line']} in {m['func'].strip()}"

    own = next((m for m in frames if not _library(m["file"])), None)
    if own is None:
        return name(frames[0])
    if own is frames[0]:
        return name(own)
    return f"{name(own)} (in {name(frames[0])})"
