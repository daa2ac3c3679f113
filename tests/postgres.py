"""A throw-away PostgreSQL server for tests where a real database is the point (the servers'
stores in tests/integration/test_auth.py, a search's Optuna study on Slurm).

PostgreSQL comes from Debian's package, installed when missing (as root, with apt).
"""

import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.services import apt_install, free_port


def _postgres_bin() -> Path | None:
    """The bin folder of the newest installed PostgreSQL server, installing it if possible."""

    def newest() -> Path | None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parts)
        return found[-1].parent if found else None

    apt_install("postgresql", lambda: newest() is not None)
    return newest()


@contextmanager
def postgres() -> Iterator[str | None]:
    """A throw-away PostgreSQL on loopback; yields `user:password@127.0.0.1:port`, or None."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        yield None
        return
    # The server refuses to run as root, and pytest's tmp folders are private to root.
    folder = Path(tempfile.mkdtemp(prefix="trainflow-pg-"))
    as_owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    password = secrets.token_urlsafe(16)
    (folder / "pw").write_text(password)
    if as_owner:
        shutil.chown(folder, "postgres", "postgres")
        shutil.chown(folder / "pw", "postgres", "postgres")
    port = free_port()
    options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={folder}"

    def pg(tool: str, *args: str) -> None:
        argv = [*as_owner, str(bin_dir / tool), *args]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{tool} failed:\n{out.stdout}{out.stderr}"

    try:
        pg("initdb", "-D", f"{folder}/data", "-U", "trainflow", "--pwfile", f"{folder}/pw",
           "--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync")  # fmt: skip
        pg(  # -t: pg_ctl's own 60 s wait ran out at load ~6.5 ("stopped waiting")
            *("pg_ctl", "-D", f"{folder}/data", "-l", f"{folder}/log", "-o", options),
            *("-w", "-t", "300", "start"),
        )
        try:
            yield f"trainflow:{password}@127.0.0.1:{port}"
        finally:
            pg("pg_ctl", "-D", f"{folder}/data", "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
