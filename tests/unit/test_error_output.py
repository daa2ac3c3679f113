"""The console filter that keeps a trainflow error to its one line (real logging, no Prefect)."""

import io
import logging
from collections.abc import Iterator

import pytest

from trainflow.flows.error_output import UserErrorEcho, quiet_user_errors
from trainflow.tasks.errors import DataError


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
        h.filters = [f for f in h.filters if not isinstance(f, UserErrorEcho)]


def test_debug_keeps_everything(
    console: tuple[logging.Logger, io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    logger, stream = console
    monkeypatch.setenv("TRAINFLOW_DEBUG", "1")
    quiet_user_errors()
    _fail(logger, DataError("cannot read image '/data/cat/c0.png' (corrupt): truncated"))
    assert "Traceback" in stream.getvalue() and stream.getvalue().count("c0.png") == 3
