"""Lines to a process's console from any of its threads: whole lines, never merged.

print() writes its text and then its end ("\\n") in two calls, so a line another thread prints
between them lands inside it: rank 0's recorder thread prints the progress lines while the
training thread prints its own (a time limit, a straggler) and a sampler thread its warnings.
`say` writes the line with its newline in one call, which Python's text stream keeps whole.
No lock: a signal handler (the time limit's, in the main thread) may say a line too.
"""

import sys


def say(line: str) -> None:
    """Write `line` and a newline to stdout in one call, then flush."""
    stream = sys.stdout
    stream.write(f"{line}\n")
    stream.flush()
