"""Why the warm command service cannot run a command as a fresh process would
(flows.warm_service): another Python, changed code or packages, an import-time setting that
differs, a resource limit the fork could not take, or a folder on the command's path that
would import another copy of a library the service has imported. The command then runs cold,
saying why."""

import contextlib
import importlib.machinery
import os
import resource
import sys
from typing import Any

from trainflow.flows.warm_command import import_time_env


def refusal(request: dict[str, Any], stamp: str, env: dict[str, str]) -> str | None:
    """Why this service cannot run the request as a fresh command would, or None."""
    if os.path.realpath(request["executable"]) != os.path.realpath(sys.executable):
        return f"the warm command service runs another Python ({sys.executable})"
    if request["stamp"] != stamp:
        return "trainflow's code or packages changed since the warm command service started"
    theirs = import_time_env(request["env"])
    differ = sorted(k for k in set(theirs) | set(env) if theirs.get(k) != env.get(k))
    if differ:
        return f"the warm command service was started with other {', '.join(differ[:3])}"
    return _unreachable_limit(request.get("limits", {})) or _shadowing(request["path"])


def _unreachable_limit(limits: dict[str, list[int]]) -> str | None:
    """Why the fork could not take the command's resource limits, or None: only a privileged
    process may raise a hard limit above its own."""
    if os.geteuid() == 0:
        return None
    for name, (_soft, hard) in limits.items():
        res = getattr(resource, name, None)
        if res is not None and _above(hard, resource.getrlimit(res)[1]):
            return f"the command's hard {name} ({hard}) is above the warm command service's"
    return None


def _above(limit: int, other: int) -> bool:
    infinite = resource.RLIM_INFINITY
    return other != infinite and (limit == infinite or limit > other)


def _shadowing(path: list[str]) -> str | None:
    """Why the command's own sys.path folders (PYTHONPATH, its project) would import another
    copy of a library the service has imported, or None: the fork uses the command's sys.path,
    and only the user's code (never imported here) may come from those folders."""
    loaded = {name.partition(".")[0] for name in sys.modules}
    for folder in path:
        if not folder or folder in sys.path or not os.path.isdir(folder):
            continue
        with contextlib.suppress(OSError):
            names = _importable_names(folder) & loaded
            clash = sorted(n for n in names if not _same_module(folder, n))
            if clash:
                return f"{folder} on the command's path holds {', '.join(clash[:3])}"
    return None


def _importable_names(folder: str) -> set[str]:
    """The top-level names `folder` would provide on sys.path: modules (.py, extension
    modules ...) and regular packages. Not files without such a suffix (a virtualenv's bin/,
    sys.path[0] of its console scripts, holds scripts named `dask`, `alembic` ...) nor folders
    without an __init__ (namespace portions: an installed module of that name outranks them)."""
    suffixes = tuple(importlib.machinery.all_suffixes())
    names = set()
    for entry in os.scandir(folder):
        if entry.is_dir():
            inits = (os.path.join(entry.path, f"__init__{suffix}") for suffix in suffixes)
            if any(os.path.isfile(init) for init in inits):
                names.add(entry.name)
        elif entry.name.endswith(suffixes):
            names.add(entry.name.partition(".")[0])
    return names


def _same_module(folder: str, name: str) -> bool:
    """Whether `name` in `folder` is the very module the service imported (the repository
    that holds the editable trainflow, say)."""
    file = getattr(sys.modules.get(name), "__file__", None)
    if not isinstance(file, str):
        return False
    origin = os.path.dirname(file) if os.path.basename(file) == "__init__.py" else file
    here = os.path.join(folder, name)
    candidates = [here, f"{here}.py"]
    return any(os.path.realpath(c) == os.path.realpath(origin) for c in candidates)
