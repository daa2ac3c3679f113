"""Local jobs stay cancellable when the submitting process started with SIGINT ignored."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SUBMITTER = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` in a script gives a process
    from trainflow.cluster.config import ClusterConfig
    from trainflow.cluster.executor import make_executor

    ex = make_executor(ClusterConfig(executor="local", ranks_per_node=1), Path(sys.argv[1]))
    job = ex.submit(time.sleep, 600)
    time.sleep(2)
    job.cancel()
    deadline = time.monotonic() + 30
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.5)
    print("done" if job.done() else "still running", flush=True)
    if not job.done():
        job._process.kill()
    """
)


@pytest.mark.services
def test_a_local_job_obeys_cancel_even_if_the_submitter_ignored_sigint(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SUBMITTER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "done", out.stdout + out.stderr[-2000:]
