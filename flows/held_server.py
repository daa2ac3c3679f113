"""Prefect's temporary server, imported but held: a fork of the `trainflow` command, or
`python -m trainflow.flows.held_server` where no fork is possible.

Most of the temporary server's boot is importing Prefect's server application (2.6 CPU s
from nothing on this 2-core machine). The `trainflow` command forks this process once it has
imported Prefect itself (then the server application is 1.6 CPU s more: Prefect's settings,
client, pydantic and the rest are shared), while it goes on with MLflow and the pipeline and
the warm-rank server checks the user's model. The fork imports the application and then
waits, listening on nothing and touching no database, for one line on a pipe. A port (the
model passed) starts the server on it, as flows.early_server starts it otherwise; end of
input (the model was refused, the command ended) ends the process: no Prefect server started.
"""

import os
import signal
import sys
import threading
import traceback
from typing import IO

from trainflow.cluster.prctl import die_with_parent
from trainflow.cluster.warm_pool import ForkedServer

SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
              "PREFECT__SERVER_FINAL": "1"}  # fmt: skip
"""What Prefect's own starter (SubprocessASGIServer) sets for its temporary server."""


def fork_held() -> ForkedServer | None:
    """This process, forked to import the server application and wait for a port on the
    returned handle's stdin; None where a fork would not be safe (other threads run: a fork
    copies only the calling thread). Call after `import prefect`: the fork shares it."""
    if threading.active_count() > 1:
        return None
    port_r, port_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    command = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(port_w)
        _close_inherited(keep=port_r)
        code = 1
        try:
            die_with_parent(signal.SIGTERM)  # a command killed outright leaves no server
            if os.getppid() != command:  # it died before that took effect
                raise SystemExit(0)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as the command's own server
            os.environ.update(SERVER_ENV)
            code = serve_when_released(os.fdopen(port_r))
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else 1
        except KeyboardInterrupt:  # Ctrl-C while held: the command says what it stopped
            code = 130
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(port_r)
    return ForkedServer(pid, port_w)


def _close_inherited(keep: int) -> None:
    """Close the command's pipes and sockets but `keep` (and stdio): their ends mean
    something to other processes (the warm-rank server ends when its stdin pipe closes)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd == keep:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("pipe:", "socket:")):
            os.close(fd)


def serve_when_released(port_line: IO[str]) -> int:
    """Import the application, wait for the port, serve on it (uvicorn's exit code: 3 if the
    port is taken); 0 at once where the input ends without one."""
    import prefect.server.api.server  # noqa: F401 -- the bulk of the boot, done while held
    import uvicorn

    line = port_line.readline().strip()
    if not line:
        return 0
    uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1",
                port=int(line), log_level="error", lifespan="on")  # fmt: skip
    return 0


def main() -> int:
    """The held server as a process of its own (its environment set by its starter)."""
    return serve_when_released(sys.stdin)


if __name__ == "__main__":
    sys.exit(main())
