"""A command timed as a user meets it: from the moment its process is launched to the first
output line that matches an event, and to its exit, with the CPU seconds it spent.

Used by P7t and P8, which start `trainflow run` and the Lightning script as fresh processes
and compare them on the same event.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEST_ACCURACY = re.compile(r"test accuracy (\d+\.\d+)")
"""The line that reports test accuracy, on either side of P7t: trainflow's rank 0 prints
`test accuracy 0.9800 (...)` once training ends; the Lightning script prints
`test accuracy 0.9780` after its test pass."""

LEFT_OUT = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_PROFILE")
"""Variables of the caller's environment a measured command never inherits: a Prefect server,
profile or tracking store other than the one the benchmark chose."""


@dataclass
class Timed:
    """One timed command."""

    returncode: int
    exit_s: float
    """Launch to exit (the process itself; descendants it leaves running are not waited on)."""
    event_s: float | None
    """Launch to the first output line matching the event; None if none matched."""
    event: str | None
    """The matched text's first group (or the whole match), e.g. '0.9800'."""
    cpu_s: float
    """User plus system CPU seconds of the process and of every descendant it waited for."""
    lines: list[str] = field(default_factory=list)
    """Its stdout and stderr lines, interleaved as they came."""

    def tail(self, n: int = 40) -> str:
        """The last n output lines, for an error message."""
        return "".join(self.lines[-n:])


def timed_command(
    argv: list[str],
    env: Mapping[str, str],
    event: re.Pattern[str] | None = None,
    timeout_s: float = 900,
    cwd: Path | None = None,
) -> Timed:
    """Run argv in a new session with stdout and stderr read line by line as they come.

    The clock starts just before the process is created. CPU seconds come from wait4's
    rusage of the process: its own and that of every descendant reaped below it (a process
    that outlives it is not counted). After timeout_s the whole session is killed.
    """
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd,
        start_new_session=True, text=True, bufsize=1,
    )  # fmt: skip
    found: list[tuple[float, str]] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if event is not None and not found and (m := event.search(line)):
                found.append((time.perf_counter() - started, m.group(m.lastindex or 0)))
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killer = threading.Timer(timeout_s, _kill_session, args=(proc.pid,))
    killer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        killer.cancel()
    exit_s = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=30)  # a descendant still holding the pipe ends the read, not the run
    return Timed(
        returncode=proc.returncode,
        exit_s=exit_s,
        # The line was printed before the exit, though it may be read just after it.
        event_s=min(found[0][0], exit_s) if found else None,
        event=found[0][1] if found else None,
        cpu_s=usage.ru_utime + usage.ru_stime,
        lines=lines,
    )


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def command_env(prefect_home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without LEFT_OUT, with unbuffered output, no Prefect
    telemetry, its own PREFECT_HOME, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LEFT_OUT}
    return {
        **env,
        "PYTHONUNBUFFERED": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(prefect_home),
        **extra,
    }


def migrated_prefect_db(file: Path) -> Path:
    """A Prefect database at the installed Prefect's head revision (`prefect server database
    upgrade`), made once and copied into each run's PREFECT_HOME: what a user who has run
    Prefect before has on disk."""
    db_url = f"sqlite+aiosqlite:///{file}"
    env = command_env(
        file.parent / "prefect-home-upgrade", PREFECT_API_DATABASE_CONNECTION_URL=db_url
    )
    argv = [sys.executable, "-m", "prefect", "--no-prompt", "server", "database", "upgrade", "-y"]
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=600)
    return file


def fresh_prefect_home(folder: Path, database: Path | None) -> Path:
    """An empty PREFECT_HOME under folder, holding a copy of `database` as its prefect.db
    (the temporary server's default database) where one is given."""
    home = folder / "prefect-home"
    home.mkdir(parents=True)
    if database is not None:
        shutil.copyfile(database, home / "prefect.db")
    return home


@contextlib.contextmanager
def running_prefect_server(folder: Path) -> Iterator[str]:
    """A real `prefect server start` on a free loopback port (its database under folder);
    yields its API URL once it answers."""
    from tests.services import prefect_server

    with prefect_server(folder) as api:
        yield api


def median(values: list[Any]) -> float | None:
    """The median, or None when any value is None (a run that never reached the event)."""
    import statistics

    if not values or any(v is None for v in values):
        return None
    return round(float(statistics.median(values)), 2)
