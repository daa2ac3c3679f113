"""Errors a user can act on. Each message says what is wrong and how to fix it."""


class TrainflowError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ConfigError(TrainflowError):
    """The configuration (preset, override or field value) is invalid."""


class DataError(TrainflowError):
    """The raw data cannot be used (unreadable, wrong shape, bad labels, NaN...)."""


class JobError(TrainflowError):
    """A training job failed; the message carries the remote traceback."""
