"""Errors a user can act on. Each message says what is wrong and how to fix it."""

import os

DEBUG_ENV = "TRAINFLOW_DEBUG"
"""Set (`trainflow --debug`) to show tracebacks: the flow's, the ranks' and dask workers'."""


def debug_enabled() -> bool:
    """Whether the user asked for tracebacks (TRAINFLOW_DEBUG set to anything but 0/empty)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class TrainflowError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ConfigError(TrainflowError):
    """The configuration (preset, override or field value) is invalid."""


class DataError(TrainflowError):
    """The raw data cannot be used (unreadable, wrong shape, bad labels, NaN...)."""


class JobError(TrainflowError):
    """A job failed: the message says how, in one line; `detail` holds what the ranks left
    (their tracebacks), shown with `trainflow --debug`."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail
        """Tracebacks and log folders behind the message ('' when there are none)."""
