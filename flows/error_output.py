"""A trainflow error shows as one clear line; Prefect's tracebacks of it only in debug mode.

Prefect logs a failing task or flow with its traceback, then echoes the error in two or three
state messages, and `trainflow run` prints it once more at the end. For a TrainflowError (bad
input, config, a failed job: its message already says what is wrong and how to fix it) that is
noise around the one line that matters. This filter keeps those records off the console; the
Prefect API still receives them, so the Prefect UI shows the failure in full. The tracebacks
in the ranks' logs, which the training task forwards line by line, are kept off the console
the same way: the job's error line says what the rank raised and where its log is. So are
submitit's routine lines in them (a rank starting, loading its pickle, completing, bypassing
a signal): its warnings and errors stay. Set TRAINFLOW_DEBUG=1 (`trainflow --debug ...`) to
see everything.
"""

import logging
import re

from trainflow.cluster import forwarded
from trainflow.errors import TrainflowError, debug_enabled

_KEY_CHARS = 48  # enough of a message to recognise its echoes, short of any quoting


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


_RANK_LINE = re.compile(r"(\[[^\]]*rank\d+[^\]]*\] )(\[rank\d+\]: ?)?(.*)", re.DOTALL)
"""A line forwarded from a rank's log: '[rank1] ...', '[0 rank1] ...', '[rank1@node2] ...',
then the '[rank1]: ' torch.distributed's excepthook puts before each line of a traceback."""
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class RankTracebacks(logging.Filter):
    """Drops the Python traceback blocks in forwarded rank log lines, from 'Traceback (most
    recent call last):' to the exception line (chained tracebacks included), per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[tuple[str, str], str] = {}
        """Per rank log file (cluster.forwarded) and rank: 'frames' inside a traceback,
        'raised' after its exception line ('torch' when torch prefixed every line of the
        block: its next prefixed lines still belong)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for the lines of a rank's traceback."""
        match = _RANK_LINE.fullmatch(record.getMessage())
        if match is None:
            return True
        rank, torch_prefix, text = match.groups()
        key = (forwarded.STREAM.get(), rank)  # a rank's stdout and stderr each on their own
        state = self.state.get(key)
        if text.startswith("Traceback (most recent call last)"):
            self.state[key] = "frames"
        elif state == "frames" and not text.startswith(" ") and text.strip():
            self.state[key] = "raised torch" if torch_prefix else "raised"  # its last line
        elif state == "raised torch" and (torch_prefix or not text.strip()):
            pass  # the rest of the exception's message, as torch printed it
        elif state == "raised" and (text.startswith(_CHAINED) or not text.strip()):
            pass
        elif state in ("raised", "raised torch"):
            del self.state[key]
            return True
        elif state is None:
            return True
        return False


_SUBMITIT_ROUTINE = re.compile(
    r"submitit (INFO \(.*\) - |WARNING \(.*\) - Bypassing signal )", re.DOTALL
)
"""submitit's lines on a rank's life that say nothing went wrong."""


class SubmititChatter(logging.Filter):
    """Drops submitit's routine lines (SUBMITIT_ROUTINE) forwarded from a rank's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a forwarded submitit INFO line or its 'Bypassing signal' warning."""
        match = _RANK_LINE.fullmatch(record.getMessage())
        return match is None or _SUBMITIT_ROUTINE.match(match.group(3)) is None


def quiet_user_errors() -> None:
    """Install the filters on the root logger's console handlers (once), unless debugging."""
    if debug_enabled():
        return
    for handler in logging.getLogger().handlers:
        for kind in (UserErrorEcho, RankTracebacks, SubmititChatter):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())
