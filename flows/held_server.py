"""Prefect's temporary server, imported but held: `python -m trainflow.flows.held_server`.

Most of the temporary server's boot (2.9 s on an idle 2-core machine, existing database) is
importing Prefect's server application. The `trainflow` command starts this process right
after the data checks, before the user's model is checked: it imports the application and
then waits, listening on nothing and touching no database, for one line on stdin. A port
(the model passed) starts the server on it, as flows.early_server starts it otherwise; end of
input (the model was refused, the command ended) ends the process: no Prefect server started.
"""

import sys


def main() -> int:
    """Import, wait for the port, serve on it (uvicorn's exit code: 3 if the port is taken)."""
    import prefect.server.api.server  # noqa: F401 -- the bulk of the boot, done while held
    import uvicorn

    line = sys.stdin.readline().strip()
    if not line:
        return 0
    uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1",
                port=int(line), log_level="error", lifespan="on")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
