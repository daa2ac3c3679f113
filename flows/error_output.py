"""A trainflow error shows as one clear line; Prefect's tracebacks of it only in debug mode.

Prefect logs a failing task or flow with its traceback, then echoes the error in two or three
state messages, and `trainflow run` prints it once more at the end. For a TrainflowError (bad
input, config, a failed job: its message already says what is wrong and how to fix it) that is
noise around the one line that matters. This filter keeps those records off the console; the
Prefect API still receives them, so the Prefect UI shows the failure in full. Set
TRAINFLOW_DEBUG=1 (`trainflow --debug ...`) to see everything.
"""

import logging
import os

from trainflow.tasks.errors import TrainflowError

DEBUG_ENV = "TRAINFLOW_DEBUG"
_KEY_CHARS = 48  # enough of a message to recognise its echoes, short of any quoting


def debug_enabled() -> bool:
    """Whether the user asked for tracebacks (TRAINFLOW_DEBUG set to anything but 0/empty)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class UserErrorEcho(logging.Filter):
    """Drops a TrainflowError's traceback record and the state messages that repeat it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        """False for records that only repeat a TrainflowError already shown or to be shown."""
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, TrainflowError):
            self.seen.add(_key(str(error)))
            return False
        if not self.seen or not record.name.startswith("prefect."):
            return True
        message = record.getMessage()
        return not any(key in message for key in self.seen)


def _key(message: str) -> str:
    """The message up to its first quote or backslash: survives repr() inside state texts."""
    cut = min((i for i, c in enumerate(message) if c in "'\"\\\n"), default=len(message))
    return message[: min(cut, _KEY_CHARS)] if cut >= 12 else message[:_KEY_CHARS]


def quiet_user_errors() -> None:
    """Install the filter on the root logger's console handlers (once), unless debugging."""
    if debug_enabled():
        return
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, UserErrorEcho) for f in handler.filters):
            handler.addFilter(UserErrorEcho())
