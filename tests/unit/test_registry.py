"""A killed watcher's job is cancelled by its watchdog, or else found and cancelled as an orphan
(real local submitit jobs, real processes)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trainflow.cluster import registry


def _wait_until(predicate: Callable[[], bool], limit_s: float = 30) -> bool:
    deadline = time.monotonic() + limit_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


def test_records_of_a_live_watcher_are_kept_and_its_watchdog_leaves_with_the_record(
    tmp_path: Path,
) -> None:
    job = registry.record(tmp_path, "123", "slurm", tmp_path)
    assert _alive(job.watchdog_pid)
    assert [j.job_id for j in registry.recorded(tmp_path)] == ["123"]
    assert registry.cancel_orphans(tmp_path) == []
    time.sleep(1.5)  # a few of the watchdog's checks: the watcher (this process) lives on
    assert _alive(job.watchdog_pid) and registry.recorded(tmp_path) == [job]
    registry.forget(tmp_path, "123")
    assert registry.recorded(tmp_path) == []
    assert _wait_until(lambda: not _alive(job.watchdog_pid), 10)
    assert not (tmp_path / "123_watchdog.log").exists()  # it cancelled nothing


_WATCHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import submitit
    from trainflow.cluster import registry

    work = Path(sys.argv[1])
    ex = submitit.LocalExecutor(work / "jobs")
    ex.update_parameters(timeout_min=5, tasks_per_node=2)
    job = ex.submit(time.sleep, 600)
    then = [sys.executable, "-c", f"open({str(work / 'then-ran')!r}, 'w').close()"]
    registry.record(work, job.job_id, "local", work / "jobs", then=then)
    print(job.job_id, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _killed_watcher(tmp_path: Path, kill_watchdog: bool) -> int:
    """Start a watcher of a local job, SIGKILL it (its watchdog first, if asked); the job id
    (its controller's pid)."""
    # stderr to a file, not a pipe: the job's controller inherits it too, so a pipe's EOF
    # would wait for the job, not for the watchdog's line.
    err = tmp_path / "watcher.err"
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        text=True,
    )
    assert watcher.stdout is not None
    controller = int(watcher.stdout.readline())
    assert _alive(controller)
    (job,) = registry.recorded(tmp_path)
    assert job.watchdog_pid and _alive(job.watchdog_pid)
    if kill_watchdog:
        os.kill(job.watchdog_pid, signal.SIGKILL)
        assert _wait_until(lambda: not _alive(job.watchdog_pid))
    watcher.send_signal(signal.SIGKILL)
    watcher.wait()
    if not kill_watchdog:  # the watchdog's line on the stderr it inherited
        said = f"the flow process {watcher.pid} that watched local job {controller}"
        assert _wait_until(lambda: said in err.read_text(), 60), err.read_text()
    return controller


def _ranks_gone(tmp_path: Path) -> bool:
    ranks = subprocess.run(["pgrep", "-f", str(tmp_path / "jobs")], capture_output=True)
    return ranks.stdout.strip() == b""


def test_the_watchdog_cancels_the_job_of_a_killed_watcher(tmp_path: Path) -> None:
    controller = _killed_watcher(tmp_path, kill_watchdog=False)
    log = tmp_path / "jobs" / f"{controller}_watchdog.log"
    said = "ended without cancelling it (killed?): cancelled it"
    assert _wait_until(lambda: log.exists() and said in log.read_text())  # no cleanup asked
    assert _wait_until(lambda: not _alive(controller)), _processes(tmp_path)
    assert _wait_until(lambda: _ranks_gone(tmp_path)), _processes(tmp_path)
    assert registry.recorded(tmp_path) == []
    assert _wait_until(lambda: (tmp_path / "then-ran").exists())  # the record's follow-up


def _processes(tmp_path: Path) -> str:
    """What a failed wait shows: the processes of the test's job, with their state."""
    ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True)
    return "\n".join(line for line in ps.stdout.splitlines() if str(tmp_path) in line)


@pytest.mark.services
def test_cleanup_cancels_the_job_of_a_watcher_killed_with_its_watchdog(tmp_path: Path) -> None:
    controller = _killed_watcher(tmp_path, kill_watchdog=True)
    time.sleep(1.0)
    assert _alive(controller)  # the orphan: nothing cancelled it
    cli = [sys.executable, "-m", "trainflow.flows.cli"]
    cleanup = [*cli, "cleanup", "--set", f"workdir={tmp_path}"]
    out = subprocess.run(cleanup, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"cancelled local job {controller} (its flow" in out.stdout
    assert _wait_until(lambda: not _alive(controller))
    assert _wait_until(lambda: _ranks_gone(tmp_path))
    assert registry.recorded(tmp_path) == []
    assert (tmp_path / "then-ran").exists()  # the follow-up the watchdog would have run


def test_a_handed_over_record_outlives_forget_until_its_cancel_is_taken(tmp_path: Path) -> None:
    # A job id no scheduler knows: its "local" cancel is taken at once (nothing to signal).
    assert not registry.hand_over("77", "not recorded by this process")
    with registry.watching(tmp_path, "77", "local", tmp_path) as job:
        assert registry.hand_over("77", "scancel got no answer in 20 s")
    assert job.watchdog_pid
    log = tmp_path / "77_watchdog.log"
    said = "could not cancel it (scancel got no answer in 20 s): cancelled it"
    # The watcher (this process) lives on: the hand-over alone set its watchdog to work.
    assert _wait_until(lambda: log.exists() and said in log.read_text(), 10)
    assert registry.recorded(tmp_path) == []
    assert _wait_until(lambda: not _alive(job.watchdog_pid), 10)
