"""Job folders only their owner can read or write, whatever the umask.

A submitit job folder holds the submitted pickle (loaded, so run, by the job) and each task's
result pickle (loaded by the flow). Under a group-friendly umask (002, common in project
spaces) anyone in the group could replace either and run their code as the job's owner. So:

- the folder is created (or tightened) 0700 before anything is written into it;
- submissions happen under umask 077, so the submitted pickle, and everything the job's
  processes write (logs, result pickles; Slurm passes the submitter's umask on to the job as
  SLURM_UMASK), is 0600; files already there are tightened after each submission;
- before the flow loads a result it checks that the folder and the pickle are its own and
  writable by nobody else, and refuses otherwise.
"""

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from submitit.core.utils import JobPaths

from trainflow.errors import JobError

_PRIVATE_UMASK = 0o077
_umask_lock = threading.Lock()


def base_folder(folder: Path) -> Path:
    """The part of a submitit folder that does not depend on the job id (%j, %A...)."""
    return JobPaths.get_first_id_independent_folder(folder)


def prepare_job_folder(folder: Path) -> None:
    """Create `folder` 0700, or make an existing one of ours 0700 (its files 0600).

    JobError when it is not a directory, or belongs to another user: a job must not be
    submitted into a folder someone else controls.
    """
    folder = base_folder(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)  # mkdir's mode can only lose bits to the umask
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise JobError(f"job folder {folder} is not a directory: remove it or use another workdir")
    if info.st_uid != os.geteuid():
        raise JobError(
            f"job folder {folder} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): "
            "use a workdir of your own"
        )
    folder.chmod(0o700)
    seal_files(folder)


def seal_files(folder: Path) -> None:
    """Make every regular file of ours directly in `folder` 0600 (symlinks are left alone)."""
    for entry in os.scandir(base_folder(folder)):
        if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == (
            os.geteuid()
        ):
            os.chmod(entry.path, 0o600)


@contextmanager
def private_umask() -> Iterator[None]:
    """Run the body under umask 077 (files 0600, folders 0700), then restore the umask.

    The umask belongs to the whole process: other threads that create files meanwhile get
    private ones too (never more open ones). The lock keeps two submissions from restoring
    each other's umask out of order.
    """
    with _umask_lock:
        previous = os.umask(_PRIVATE_UMASK)
        try:
            yield
        finally:
            os.umask(previous)


def check_private(folder: Path, pickles: list[Path]) -> None:
    """JobError unless `folder` and each existing pickle are ours and writable only by us.

    Called before the flow loads a result pickle: loading one runs code.
    """
    for path in [folder, *(p for p in pickles if p.exists())]:
        info = path.lstat()
        why = ""
        if stat.S_ISLNK(info.st_mode):
            why = "is a symbolic link"
        elif info.st_uid != os.geteuid():
            why = f"belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})"
        elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = "its group" if info.st_mode & stat.S_IWGRP else "other users"
            why = f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o})"
        if why:
            raise JobError(
                f"refusing to load the job's results: {path} {why}, so someone else could have "
                "replaced a result pickle (loading one runs its code). Check the folder, make "
                f"it yours and private (chmod -R go-w {folder}), then rerun"
            )
