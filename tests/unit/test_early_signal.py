"""A requeue signal during a rank's start-up requeues the job instead of killing it."""

from pathlib import Path

import pytest
import submitit

from tests.unit.early_signal_payload import Job


@pytest.mark.services
def test_a_signal_while_the_job_still_imports_requeues_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mark = tmp_path / "mark"
    monkeypatch.setenv("TRAINFLOW_TEST_MARK", str(mark))
    executor = submitit.LocalExecutor(tmp_path / "jobs")
    executor.update_parameters(timeout_min=2)
    job = executor.submit(Job())
    # Without the holder the first attempt dies of the signal and result() raises.
    assert job.result() == "finished after signalled during import"
    log = Path(job.paths.stderr).read_text() + Path(job.paths.stdout).read_text()
    assert "requeue" in log.lower() or "checkpoint" in log.lower(), log[-2000:]
