"""A dead flow's job is cancelled even when slurmctld does not answer at first (real cluster).

The watchdog (cluster.job_watchdog) of a job whose watcher died while this worker's slurmctld
was stopped (SIGSTOP: the controller of a loaded cluster that does not answer) retries the
cancel until the controller answers again, and the job leaves the queue.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.services import wait_for
from trainflow.cluster import registry
from trainflow.cluster.dev.slurm import slurm_home

_WATCHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from trainflow.cluster import registry

    registry.record(Path(sys.argv[1]), sys.argv[2], "slurm", Path(sys.argv[1]))
    print("recorded", flush=True)
    time.sleep(600)
    """
)


def _in_squeue(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    return bool(out.stdout.strip())


def test_the_watchdog_retries_the_cancel_until_slurmctld_answers(tmp_path: Path) -> None:
    sbatch = ["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 600"]
    job_id = subprocess.run(sbatch, capture_output=True, text=True, check=True).stdout.strip()
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(tmp_path), job_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert watcher.stdout is not None and watcher.stdout.readline().strip() == "recorded"
    ctld = int((slurm_home() / "run" / "slurmctld.pid").read_text())
    os.kill(ctld, signal.SIGSTOP)
    try:
        watcher.kill()
        watcher.wait()
        log = tmp_path / f"{job_id}_watchdog.log"
        # scancel gives up on a controller that does not answer (MessageTimeout, 10 s)
        wait_for(lambda: log.exists() and "(try 1)" in log.read_text(), 60, "a failed cancel")
    finally:
        os.kill(ctld, signal.SIGCONT)
    done = "ended without cancelling it (killed?): cancelled it"
    wait_for(lambda: done in log.read_text(), 60, "the watchdog to cancel the job")
    wait_for(lambda: not _in_squeue(job_id), 60, f"job {job_id} to leave squeue")
    assert registry.recorded(tmp_path) == []
