"""cgroup v1 memory groups for the tests that prove a memory limit (needs root)."""

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

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
