"""Which rank log file a forwarded line comes from, while the line is being logged.

cluster.jobs hands each new line of every rank's stdout and stderr files to the flow's logger,
both under the rank's prefix (`[rank0] `). The console's traceback filter
(flows.error_output.RankTracebacks) must follow each file on its own: a traceback is written to
one of them, and a line of the other may be forwarded between two of its lines (submitit writes
its "Submitted job triggered an exception" line to both files, and a poll can read the
traceback's start from stderr before that line reaches stdout). Read by a logging filter, which
runs in the thread that logs: the forwarding thread.
"""

from contextvars import ContextVar

STREAM: ContextVar[str] = ContextVar("trainflow_forwarded_stream", default="")
"""The path of the rank log file whose line is being logged; '' for any other log record."""
