"""cgroup v1 memory groups for the tests that prove a memory limit (needs root)."""

import os
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
