"""The code that runs is the code that was submitted: a per-run snapshot of the user's modules.

submitit pickles by reference, so a rank imports the user's module when it starts: a job that
waits in the queue, or is requeued, would run whatever the files hold then. At submission the
flow copies the user's code into the run's private job folder; ranks, dask workers and every
requeued or restarted attempt put that copy first on sys.path before importing anything of
the user's (`code_first`; dask workers through cluster.dask_snapshot.SnapshotFirst).

What belongs to a module's snapshot (its *root* is the sys.path folder it was imported from):
- inside a git work tree: the root's files git knows of (tracked, plus untracked ones that are
  not ignored), read from the working tree as they are at submission;
- else, a module inside a package: its top-level package folder (every file but __pycache__);
- else, a top-level module: its file and the .py files beside it.
Modules installed in site-packages, the standard library and trainflow (its modules, and a
`trainflow/` folder beside the user's code) are never snapshotted: the environment holds them.
A snapshot over MAX_SNAPSHOT_BYTES is refused.
"""

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from trainflow.cluster.job_folder import prepare_job_folder, private_umask
from trainflow.errors import ConfigError

MAX_SNAPSHOT_BYTES = 64 * 2**20
"""Largest snapshot accepted (code, not data: keep data out of the code's folder)."""


@dataclass(frozen=True)
class SnapshotPlan:
    """What a snapshot will copy: per root folder, its files (relative paths)."""

    roots: dict[Path, list[str]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Bytes of every file listed."""
        return sum((root / f).stat().st_size for root, files in self.roots.items() for f in files)


@dataclass(frozen=True)
class CodeSnapshot:
    """A written snapshot: the folders to put first on sys.path, and the content hash."""

    paths: list[Path]
    """One folder per root, in plan order."""
    sha256: str
    """Hash over every file's relative path and bytes (the MLflow tag code_snapshot_hash)."""
    folder: Path
    """The snapshot's folder (logged as the parent run's artifact code/)."""


def plan_snapshot(modules: Iterable[str]) -> SnapshotPlan:
    """The files of the imported `modules` that a snapshot holds (see the module docstring);
    ConfigError when they exceed MAX_SNAPSHOT_BYTES."""
    roots: dict[Path, set[str]] = {}
    for name in modules:
        found = _module_root(name)
        if found is not None:
            roots.setdefault(found[0], set()).update(_files(name, *found))
    # Never a copy of trainflow itself (a project inside a trainflow checkout): first on
    # sys.path it would shadow the installed trainflow.
    roots = {
        root: {f for f in files if f.split("/")[0] != "trainflow"} for root, files in roots.items()
    }
    plan = SnapshotPlan({root: sorted(files) for root, files in roots.items()})
    size = plan.size
    if size > MAX_SNAPSHOT_BYTES:
        where = ", ".join(str(r) for r in plan.roots)
        raise ConfigError(
            f"the code snapshot of {where} would take {size / 2**20:.0f} MiB (at most "
            f"{MAX_SNAPSHOT_BYTES // 2**20} MiB): keep data out of your code's folder "
            "(.gitignore it), or pip install your code as a package"
        )
    return plan


def take_snapshot(plan: SnapshotPlan, folder: Path) -> CodeSnapshot | None:
    """Copy the plan's files into folder/<root index>/ and hash them; None for an empty plan."""
    if not plan.roots:
        return None
    digest = hashlib.sha256()
    paths = []
    for index, (root, files) in enumerate(plan.roots.items()):
        target = folder / str(index)
        for rel in files:
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = (root / rel).read_bytes()  # hashed as copied: the bytes that will run
            dest.write_bytes(data)
            digest.update(f"{index}/{rel}\0{len(data)}\0".encode())
            digest.update(data)
        paths.append(target)
    return CodeSnapshot(paths=paths, sha256=digest.hexdigest(), folder=folder)


def snapshot_for_jobs(modules: Iterable[str], job_dir: Path) -> CodeSnapshot | None:
    """Snapshot the user's `modules` into job_dir/code (private, like the job's pickle)."""
    plan = plan_snapshot(modules)
    if not plan.roots:
        return None
    prepare_job_folder(job_dir)
    with private_umask():
        return take_snapshot(plan, job_dir / "code")


def code_first(paths: Iterable[Path]) -> None:
    """Put the snapshot's folders first on sys.path (idempotent), so the user's modules
    import from the submitted copy; called by every rank and dask worker before any import."""
    for path in reversed([str(p) for p in paths]):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    importlib.invalidate_caches()


@contextmanager
def code_path(paths: Iterable[Path]) -> Iterator[None]:
    """code_first for the body only (in-process runs: the debug executor, tests)."""
    before = list(sys.path)
    code_first(paths)
    try:
        yield
    finally:
        sys.path[:] = before


def _module_root(name: str) -> tuple[Path, list[str]] | None:
    """(the sys.path folder `name` was imported from, its dotted parts), or None when it is
    installed, trainflow's own, or has no file."""
    if name.split(".")[0] == "trainflow":
        return None
    module = sys.modules.get(name) or importlib.import_module(name)
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    path = Path(file).resolve()
    if _installed(path):
        return None
    parts = name.split(".")
    depth = len(parts) if path.name == "__init__.py" else len(parts) - 1
    return path.parents[depth], parts


def user_module(name: str) -> bool:
    """Whether the imported module `name` is the user's own code (a file outside the
    environment, not trainflow's): what a snapshot copies."""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if name.split(".")[0] == "trainflow" or not isinstance(file, str):
        return False
    return not _installed(Path(file).resolve())


def _installed(path: Path) -> bool:
    prefixes = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    places = [Path(p).resolve() for p in prefixes]
    return any(path.is_relative_to(place) for place in places) or "site-packages" in path.parts


def _files(name: str, root: Path, parts: list[str]) -> set[str]:
    """Relative paths under `root` that belong to the snapshot of module `name`."""
    tracked = _git_files(root)
    if tracked is not None:
        return tracked
    package = root / parts[0]
    if package.is_dir():
        return {
            str(p.relative_to(root))
            for p in package.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
    return {p.name for p in root.glob("*.py") if p.is_file()}


def _git_files(root: Path) -> set[str] | None:
    """Files under `root` that git tracks or would track (not ignored); None outside git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "."],
            cwd=root,
            capture_output=True,
            timeout=60,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    names = [n for n in out.stdout.decode().split("\0") if n]
    return {n for n in names if (root / n).is_file()}
