"""Orphaned jobs of a killed watcher are found and cancelled (real local submitit jobs)."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from trainflow.cluster import registry


def test_records_of_a_live_watcher_are_kept(tmp_path: Path) -> None:
    registry.record(tmp_path, "123", "slurm", tmp_path)
    assert [j.job_id for j in registry.recorded(tmp_path)] == ["123"]
    assert registry.cancel_orphans(tmp_path) == []
    registry.forget(tmp_path, "123")
    assert registry.recorded(tmp_path) == []


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
    registry.record(work, job.job_id, "local", work / "jobs")
    print(job.job_id, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_job_of_a_killed_watcher_is_cancelled(tmp_path: Path) -> None:
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert watcher.stdout is not None
    controller = int(watcher.stdout.readline())
    assert _alive(controller)
    watcher.send_signal(signal.SIGKILL)
    watcher.wait()
    assert _alive(controller)  # the orphan: nothing cancelled it
    orphans = registry.cancel_orphans(tmp_path)
    assert [j.job_id for j in orphans] == [str(controller)]
    deadline = time.monotonic() + 30
    while _alive(controller) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(controller)
    ranks = subprocess.run(["pgrep", "-f", str(tmp_path / "jobs")], capture_output=True)
    assert ranks.stdout.strip() == b""
    assert registry.recorded(tmp_path) == []
