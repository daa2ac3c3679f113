"""Errors a user can act on. Each message says what is wrong and how to fix it."""


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
