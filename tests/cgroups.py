"""cgroup v1 memory groups for the tests that prove a memory limit (needs root)."""

import contextlib
import errno
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

V1 = Path("/sys/fs/cgroup/memory")


def memory_group_of(pid: int | str = "self") -> Path | None:
    """The memory cgroup (v1) process `pid` is in, if it is in one."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _id, controllers, group = line.split(":", 2)
        if "memory" in controllers.split(","):
            return V1 / group.lstrip("/")
    return None


def own_memory_group() -> Path | None:
    """This process's memory cgroup (v1), when we may create groups under it."""
    if os.geteuid() != 0 or not V1.is_dir():
        return None
    path = memory_group_of()
    return path if path is not None and os.access(path, os.W_OK) else None


def remove_group(group: Path, limit_s: float = 30.0) -> None:
    """Move what is left in `group` to its parent and remove it. A process that is exiting
    still counts until its parent reaps it (rmdir: EBUSY), and one being forked may appear
    after the move: retry until the group is empty, for at most `limit_s`."""
    deadline = time.monotonic() + limit_s
    while True:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone already, or a zombie: reaped soon
                (group.parent / "cgroup.procs").write_text(pid)
        try:
            group.rmdir()
            return
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def drain_and_remove(group: Path, wait_s: float = 60.0) -> None:
    """Wait for the payload's last processes (a job's slurmstepd, dask's resource tracker) to
    leave `group`; kill any still there after `wait_s` (started by the test), then remove it
    (remove_group's retries cover a killed process not yet reaped)."""
    deadline = time.monotonic() + wait_s
    while (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    remove_group(group)


@contextlib.contextmanager
def memory_groups() -> Iterator[Callable[[int], Path]]:
    """Makes uniquely named memory cgroups under this process's, each limited to its `limit`
    in bytes (memory and memory+swap); drains and removes them after. Skips the test where no
    group can be made (not root, no writable cgroup v1 memory controller)."""
    parent = own_memory_group()
    if parent is None:
        pytest.skip("needs root and a writable cgroup v1 memory controller")
    made: list[Path] = []

    def make(limit: int) -> Path:
        group = parent / f"trainflow-test-{uuid.uuid4().hex[:12]}"
        group.mkdir()
        made.append(group)
        (group / "memory.limit_in_bytes").write_text(str(limit))
        memsw = group / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(limit))
        return group

    try:
        yield make
    finally:
        for group in made:
            drain_and_remove(group)


@dataclass(frozen=True)
class GroupRun:
    """A command that ran inside a memory group, and what the group recorded."""

    done: "subprocess.CompletedProcess[str]"
    oom: str
    """memory.oom_control after the run."""
    peak: int
    """memory.max_usage_in_bytes: the group's peak, page cache included."""

    def assert_held(self, limit: int) -> None:
        """The command succeeded, nothing was OOM-killed and the peak stayed under `limit`."""
        detail = f"{self.oom}\n{self.done.stdout[-2000:]}\n{self.done.stderr[-3000:]}"
        assert self.done.returncode == 0, detail
        assert "oom_kill 0" in self.oom or "oom_kill" not in self.oom, detail
        assert self.peak <= limit, f"group peak {self.peak >> 20} MiB > {limit >> 20} MiB"


def run_in_group(
    group: Path, argv: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> GroupRun:
    """Run `argv` with its process (and so all it starts) inside `group`."""
    procs = group / "cgroup.procs"
    done = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=lambda: procs.write_text(str(os.getpid())),
    )
    oom = (group / "memory.oom_control").read_text()
    return GroupRun(done, oom, int((group / "memory.max_usage_in_bytes").read_text()))
