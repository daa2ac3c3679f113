"""A job is cancelled even when slurmctld does not answer at first (real cluster).

The controller of a loaded cluster that does not answer is this worker's slurmctld stopped
(SIGSTOP). The watchdog (cluster.job_watchdog) of a job whose watcher died then retries the
cancel until the controller answers again, and the job leaves the queue. A watcher that is
interrupted (Ctrl-C) then cannot cancel its job itself: it hands the cancel to the watchdog,
which cancels the job as soon as the controller answers, whether the watcher lives on or not.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.services import in_squeue, service_env, wait_for
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


_INTERRUPTED_WATCHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import submitit
    from trainflow.cluster import registry
    from trainflow.cluster.jobs import wait_for_job

    work, job_id = Path(sys.argv[1]), sys.argv[2]
    job = submitit.SlurmJob(folder=work, job_id=job_id)
    try:
        with registry.watching(work, job_id, "slurm", work):  # as the train stage does
            wait_for_job(job, print)  # prints the job's log lines: "[rank0] started" first
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    time.sleep(600)
    """
)


def _sleeping_job(log: str = "/dev/null") -> str:
    sbatch = ["sbatch", "--parsable", "-o", log, "--wrap", "echo started; sleep 600"]
    return subprocess.run(sbatch, capture_output=True, text=True, check=True).stdout.strip()


def test_the_watchdog_retries_the_cancel_until_slurmctld_answers(tmp_path: Path) -> None:
    job_id = _sleeping_job()
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
    wait_for(lambda: not in_squeue(job_id), 60, f"job {job_id} to leave squeue")
    assert registry.recorded(tmp_path) == []


def test_a_cancel_slurmctld_does_not_take_is_handed_to_the_watchdog(tmp_path: Path) -> None:
    job_id = _sleeping_job(f"{tmp_path}/%j_0_log.out")  # where submitit reads task 0's log
    with (tmp_path / "watcher.err").open("w") as err:
        watcher = subprocess.Popen(
            [sys.executable, "-c", _INTERRUPTED_WATCHER, str(tmp_path), job_id],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline().strip() == "[rank0] started"  # it follows the job
        ctld = int((slurm_home() / "run" / "slurmctld.pid").read_text())
        os.kill(ctld, signal.SIGSTOP)
        try:
            watcher.send_signal(signal.SIGINT)
            # Its scancel gives up (MessageTimeout, 10 s), then the interrupt goes on.
            assert watcher.stdout.readline().strip() == "interrupted"
            (record,) = registry.recorded(tmp_path)  # kept: the watchdog's to cancel
            assert record.cancel_requested
            # `trainflow cleanup` meanwhile: refused too, it says so and keeps the record.
            cli = [sys.executable, "-m", "trainflow.flows.cli", "cleanup"]
            cleanup = subprocess.run(
                [*cli, "--set", f"workdir={tmp_path}"],
                capture_output=True,
                text=True,
                timeout=120,
                env=service_env(),
            )
            assert cleanup.returncode == 1, cleanup.stdout + cleanup.stderr
            refused = f"the scheduler refused the cancel of slurm job {job_id}"
            assert refused in cleanup.stderr and "could not cancel it: scancel" in cleanup.stderr
            assert registry.recorded(tmp_path) == [record]
        finally:
            os.kill(ctld, signal.SIGCONT)
        log = tmp_path / f"{job_id}_watchdog.log"
        said = f"the flow process {watcher.pid} that watched slurm job {job_id} could not cancel it"
        wait_for(
            lambda: log.exists() and said in log.read_text() and "cancelled it" in log.read_text(),
            60,
            "the watchdog to cancel the job",
        )
        wait_for(lambda: not in_squeue(job_id), 60, f"job {job_id} to leave squeue")
        assert watcher.poll() is None  # the hand-over set the watchdog to work, not a death
        assert registry.recorded(tmp_path) == []
        assert f"could not cancel job {job_id} (" in (tmp_path / "watcher.err").read_text()
        assert "its watchdog keeps trying" in (tmp_path / "watcher.err").read_text()
    finally:
        watcher.kill()
        watcher.wait()
