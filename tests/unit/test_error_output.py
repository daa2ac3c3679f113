"""The console filter that keeps a trainflow error to its one line (real logging, no Prefect)."""

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainflow.cluster import jobs
from trainflow.cluster.jobs import LogTail
from trainflow.errors import DataError, JobError
from trainflow.flows.error_output import (
    RankTracebacks,
    SubmititChatter,
    UserErrorEcho,
    quiet_user_errors,
)

OURS = (UserErrorEcho, RankTracebacks, SubmititChatter)
"""The filters quiet_user_errors installs (removed after each test)."""


@pytest.fixture
def console() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A prefect.* logger whose records reach a console handler on the root logger."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    logger = logging.getLogger("prefect.task_runs.test")
    logger.setLevel(logging.INFO)
    yield logger, stream
    root.removeHandler(handler)


def _fail(logger: logging.Logger, error: Exception) -> None:
    try:
        raise error
    except Exception as err:
        logger.error(
            "Task run failed with exception: %r - Retries are exhausted", err, exc_info=True
        )
    logger.error("Finished in state Failed('Task run encountered an exception %r')", error)
    logger.info("an unrelated line")


def test_trainflow_errors_lose_tracebacks_and_echoes(
    console: tuple[logging.Logger, io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    logger, stream = console
    monkeypatch.delenv("TRAINFLOW_DEBUG", raising=False)
    quiet_user_errors()
    quiet_user_errors()  # idempotent: one filter per handler
    handlers = logging.getLogger().handlers
    assert all(sum(isinstance(f, UserErrorEcho) for f in h.filters) == 1 for h in handlers)
    _fail(logger, DataError("cannot read image '/data/cat/c0.png' (corrupt): truncated"))
    assert stream.getvalue() == "an unrelated line\n"
    _fail(logger, RuntimeError("a bug of ours"))  # anything else keeps its traceback
    assert "Traceback" in stream.getvalue() and "a bug of ours" in stream.getvalue()
    for h in handlers:
        h.filters = [f for f in h.filters if not isinstance(f, OURS)]


def test_debug_keeps_everything(
    console: tuple[logging.Logger, io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    logger, stream = console
    monkeypatch.setenv("TRAINFLOW_DEBUG", "1")
    quiet_user_errors()
    _fail(logger, DataError("cannot read image '/data/cat/c0.png' (corrupt): truncated"))
    assert "Traceback" in stream.getvalue() and stream.getvalue().count("c0.png") == 3


_RANK_LOG = "\n".join(
    [
        "[rank1] submitit ERROR (2026-11-24 01:21:42,775) - Submitted job triggered an exception",
        "[rank1] Traceback (most recent call last):",
        '[rank1]   File "/x/data.py", line 10, in open_npy',
        "[rank1]     return np.load(file)",
        "[rank1]            ^^^^^^^^^^^^^",
        "[rank1] OSError: [Errno 24] Too many open files",
        "[rank1] ",
        "[rank1] The above exception was the direct cause of the following exception:",
        "[rank1] ",
        "[rank0@n2] epoch 1/2 loss 0.5",
        "[rank1] Traceback (most recent call last):",
        '[rank1]   File "/x/job.py", line 3, in __call__',
        "[rank1] trainflow.errors.DataError: cannot read shard '/d/train-00001.x.npy'",
        "[rank1] rank_guard: a line after the traceback",
        "[rank0] [rank0]: Traceback (most recent call last):",
        '[rank0] [rank0]:   File "/x/loop.py", line 3, in step',
        "[rank0] [rank0]: torch._inductor.exc.InductorError: InvalidCxxCompiler: No compiler",
        "[rank0] ",
        "[rank0] [rank0]: Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace",
        "[rank0] submitit ERROR (2026-11-24 01:21:46,088) - Submitted job triggered an exception",
    ]
)


@pytest.mark.parametrize("debug", ["", "1"])
def test_rank_tracebacks_stay_off_the_console_unless_debugging(
    console: tuple[logging.Logger, io.StringIO], monkeypatch: pytest.MonkeyPatch, debug: str
) -> None:
    logger, stream = console
    monkeypatch.setenv("TRAINFLOW_DEBUG", debug)
    quiet_user_errors()
    for line in _RANK_LOG.splitlines():
        logger.info(line)
    if debug:
        assert stream.getvalue() == _RANK_LOG + "\n"
    else:
        assert stream.getvalue().splitlines() == [
            "[rank1] submitit ERROR (2026-11-24 01:21:42,775) - Submitted job triggered an "
            "exception",
            "[rank0@n2] epoch 1/2 loss 0.5",
            "[rank1] rank_guard: a line after the traceback",
            "[rank0] submitit ERROR (2026-11-24 01:21:46,088) - Submitted job triggered an "
            "exception",
        ]
    for h in logging.getLogger().handlers:
        h.filters = [f for f in h.filters if not isinstance(f, OURS)]


def test_a_traceback_stays_off_the_console_when_the_other_stream_interleaves(
    console: tuple[logging.Logger, io.StringIO], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As a failed rank's files are followed (cluster.jobs): a poll reads the start of the
    traceback from stderr; submitit's error line reaches stdout only before the next poll,
    which forwards it (stdout first) between two lines of the traceback (seen in make test)."""
    logger, stream = console
    monkeypatch.delenv("TRAINFLOW_DEBUG", raising=False)
    quiet_user_errors()
    out, err = tmp_path / "7_0_log.out", tmp_path / "7_0_log.err"
    tails = [LogTail(out, "[rank0] "), LogTail(err, "[rank0] ")]
    error_line = "submitit ERROR (2026-11-27 06:39:26,187) - Submitted job triggered an exception"
    out.write_text("epoch 1/2 loss 0.5\n")
    err.write_text(f'{error_line}\nTraceback (most recent call last):\n  File "a.py", line 1\n')
    jobs._forward(tails, logger.info)
    with out.open("a") as f:
        f.write(f"{error_line}\n")
    with err.open("a") as f:
        f.write('    g()\n  File "b.py", line 2, in g\n')
        f.write("trainflow.errors.ConfigError: no GPU\n")
    jobs._forward(tails, logger.info, final=True)
    assert stream.getvalue().splitlines() == [
        "[rank0] epoch 1/2 loss 0.5",
        f"[rank0] {error_line}",  # stderr's
        f"[rank0] {error_line}",  # stdout's
    ]
    for h in logging.getLogger().handlers:
        h.filters = [f for f in h.filters if not isinstance(f, OURS)]


def test_submitit_s_routine_lines_stay_off_the_console_its_warnings_do_not(
    console: tuple[logging.Logger, io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    logger, stream = console
    monkeypatch.delenv("TRAINFLOW_DEBUG", raising=False)
    quiet_user_errors()
    stamp = "(2026-11-27 19:41:25,172)"
    lines = [
        f"[0 rank0] submitit INFO {stamp} - Starting with JobEnvironment(job_id=7082)",
        f"[0 rank1] submitit INFO {stamp} - Loading pickle: /w/7082_submitted.pkl",
        "[0 rank0] epoch 2/2 loss 0.0004 acc 1.0000",
        f"[rank1@n2] submitit WARNING {stamp} - Bypassing signal SIGCONT",
        f"[rank0] submitit WARNING {stamp} - Caught signal SIGUSR2 on vm: this job is timed-out.",
        f"[rank0] submitit INFO {stamp} - Job completed successfully",
        f"submitit INFO {stamp} - not from a rank",
    ]
    for line in lines:
        logger.info(line)
    assert stream.getvalue().splitlines() == [lines[2], lines[4], lines[6]]
    for h in logging.getLogger().handlers:
        h.filters = [f for f in h.filters if not isinstance(f, OURS)]


@pytest.mark.parametrize("debug", [False, True])
def test_a_failed_jobs_tracebacks_show_only_with_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], debug: bool
) -> None:
    from trainflow.flows import cli, commands

    def failed_job(args: object) -> int:
        raise JobError("job 7 failed in rank 1: rank 1 raised DataError: x", "----- rank 1 -----")

    monkeypatch.setenv("TRAINFLOW_DEBUG", "0")  # restored after main() sets it for --debug
    monkeypatch.setattr(commands, "run", failed_job)
    assert cli.main([*(["--debug"] if debug else []), "run", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("trainflow: error: job 7 failed in rank 1: rank 1 raised DataError: x\n")
    assert ("----- rank 1 -----" in err) is debug


@pytest.mark.parametrize(
    "error",
    [
        OSError(24, "Too many open files"),
        JobError("job 7 failed in rank 1: rank 1 raised OSError: [Errno 24] Too many open files"),
    ],
)
def test_too_many_open_files_anywhere_is_one_line_naming_the_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: Exception
) -> None:
    from trainflow.flows import cli, commands

    def failing(args: object) -> int:
        raise error

    monkeypatch.setenv("TRAINFLOW_DEBUG", "0")
    monkeypatch.setattr(commands, "run", failing)
    assert cli.main(["run", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainflow: error: ")
    assert "too many open files: this process may hold" in err and "ulimit -n" in err
    assert "preprocess again" not in err
