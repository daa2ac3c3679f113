"""A rank guard's judgement of its rank's heartbeat (cluster.heartbeat): whether the rank is hung
(silent past its phase's allowance, and not merely waiting for a slower peer), and ending a hung
rank with its stacks in its log (cluster.rank_guard polls it once a second)."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainflow.cluster.heartbeat import (
    BEAT_ENV,
    STACK_SIGNAL,
    STACKS_ENV,
    Beat,
    decode,
    in_collective,
    position,
    read_beat,
    stuck_frame,
)

DUMP_WAIT_S = 2.0
"""How long the guard waits for a hung rank's stacks before it kills the rank."""


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


class HangWatch:
    """Judges a rank's heartbeat (cluster.heartbeat) once a poll, and ends a hung rank.

    Silence is measured on this guard's clock from the last time the file's bytes changed.
    A rank silent past its allowance is hung, unless a peer of this attempt is behind it (fewer
    steps, or an earlier phase of the same step: cluster.heartbeat.position; at the same
    position, silent longer): this rank is then most likely waiting for that peer in a
    collective, and the peer's guard acts first. While that peer is within its own allowance
    (e.g. rank 0 saving a checkpoint while the others wait in the next step's all-reduce) this
    rank waits with it; once the peer is overdue, this rank is ended past twice its allowance
    if the peer's guard has not acted."""

    def __init__(self, folder: Path, job_id: str, task: int, since: float) -> None:
        self.folder, self.job_id, self.task, self.since = folder, job_id, task, since
        self.beat_path = folder / f"{job_id}_{task}_beat"
        self.stacks = folder / f"{job_id}_{task}_stacks.txt"
        for stale in (self.beat_path, self.stacks):  # an earlier attempt's (a Slurm requeue)
            stale.unlink(missing_ok=True)
        self._raw = b""
        self._changed = time.monotonic()
        self._deferred = False
        self._collective: bool | None = None
        self.record: dict[str, Any] | None = None
        """What the guard recorded of a hung rank it ended; None while none."""

    def env(self) -> dict[str, str]:
        """The variables that tell the rank where to beat and to dump its stacks."""
        return {BEAT_ENV: str(self.beat_path), STACKS_ENV: str(self.stacks)}

    def _in_collective(self, child: "subprocess.Popen[bytes]") -> bool:
        """Whether the rank's main thread waits in torch.distributed (from a dump of its
        stacks, taken once per silence)."""
        if self._collective is None:
            offset = self._stacks_size()
            try:
                child.send_signal(STACK_SIGNAL)
            except OSError:
                return False
            self._collective = in_collective(self._dump(offset))
        return self._collective

    def _stacks_size(self) -> int:
        try:
            return self.stacks.stat().st_size
        except OSError:
            return 0

    def hung(self, child: "subprocess.Popen[bytes]") -> tuple[Beat, float] | None:
        """(its last beat, seconds silent) when the rank is hung, else None."""
        try:
            raw = self.beat_path.read_bytes()
        except OSError:
            return None
        now = time.monotonic()
        if raw != self._raw:
            self._raw, self._changed, self._deferred = raw, now, False
            self._collective = None
            return None
        beat = decode(raw)
        silent = now - self._changed
        if beat is None or silent <= beat.allowed_s:
            return None
        peer = self._peer_behind(beat)
        if peer is None:
            return beat, silent
        task, within, level = peer
        # Level with a peer: the one waiting in a collective is not the one stuck.
        waits = not level or self._in_collective(child)
        if waits and (within or silent <= 2 * beat.allowed_s):
            if not self._deferred:
                self._deferred = True
                where = "waits in a collective level with" if level else "is ahead of"
                print(
                    f"rank_guard: no progress for {silent:.0f} s in phase {beat.phase}, but this "
                    f"rank {where} rank {task}: leaving it to that rank's guard",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        return beat, silent

    def _peer_behind(self, beat: Beat) -> tuple[int, bool, bool] | None:
        """(task, whether it is still within its own allowance, whether it is level with this
        rank) of a peer of this attempt, still running, that is behind this rank (whose last
        beat is `beat`), else one level with it; None if none."""
        pattern = re.compile(rf"{re.escape(self.job_id)}_(\d+)_beat")
        level: tuple[int, bool, bool] | None = None
        for path in self.folder.glob(f"{self.job_id}_*_beat"):
            match = pattern.fullmatch(path.name)
            if not match or int(match[1]) == self.task:
                continue
            other = read_beat(path)
            if other is None or other.at < self.since:
                continue
            if position(other) > position(beat):
                continue
            try:
                ended = json.loads(
                    (self.folder / f"{self.job_id}_{match[1]}_exit.json").read_text()
                )
                if float(ended.get("ended", 0)) >= self.since:
                    continue
            except (OSError, ValueError, AttributeError):
                pass
            within = time.time() - other.at <= other.allowed_s
            if position(other) < position(beat):
                return int(match[1]), within, False
            level = level or (int(match[1]), within, True)
        return level

    def end(self, child: "subprocess.Popen[bytes]", beat: Beat, silent: float) -> int:
        """Dump the hung rank's stacks into its log, kill it, record why; its exit code."""
        print(
            f"rank_guard: this rank made no progress for {silent:.0f} s in phase {beat.phase} "
            f"(step {beat.step}; {beat.allowed_s:.0f} s allowed): dumping its stacks, then "
            "ending it",
            file=sys.stderr,
            flush=True,
        )
        offset = self._stacks_size()
        try:
            child.send_signal(STACK_SIGNAL)
            if _stopped(child.pid):
                child.send_signal(signal.SIGCONT)  # a stopped rank dumps once it runs again
        except OSError:
            pass
        dump = self._dump(offset)
        print(
            "rank_guard: stacks of the hung rank (all threads, most recent call first):\n"
            + (dump.rstrip() or "(none written)"),
            file=sys.stderr,
            flush=True,
        )
        child.kill()
        returncode = child.wait()
        if returncode != -signal.SIGKILL:  # it ended by itself meanwhile: not hung after all
            return returncode
        self.record = {
            "phase": beat.phase,
            "step": beat.step,
            "silent_s": round(silent, 1),
            "allowed_s": beat.allowed_s,
            "since": beat.at,
            "frame": stuck_frame(dump),
        }
        return returncode

    def _dump(self, offset: int) -> str:
        """The stacks the rank wrote, once the file stops growing (at most DUMP_WAIT_S). Read
        often: a stopped rank runs on once resumed, until it is killed."""
        deadline = time.monotonic() + DUMP_WAIT_S
        last = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                with self.stacks.open(errors="replace") as file:
                    file.seek(offset)
                    text = file.read()
            except OSError:
                continue
            if text and text == last:
                break
            last = text
        return last
