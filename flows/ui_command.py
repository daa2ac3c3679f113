"""`trainflow ui`: the MLflow UI on the store a pipeline's runs used (`mlflow ui` itself)."""

import socket
from pathlib import Path

from trainflow.errors import ConfigError
from trainflow.flows.config import PipelineConfig


def ui_args(cfg: PipelineConfig, port: int, host: str = "127.0.0.1") -> list[str]:
    """`mlflow ui`'s arguments serving the store (and artifacts) the pipeline's runs used."""
    from trainflow.tasks.tracking.config import resolve_tracking_uri

    uri = resolve_tracking_uri(cfg.tracking, cfg.workdir)
    args = ["ui", "--backend-store-uri", uri]
    if local_store_path(uri) is not None:
        # Local runs keep artifacts under <workdir>/mlartifacts (file:// locations the server
        # reads directly); experiments the UI itself creates proxy to the same folder.
        args += ["--artifacts-destination", str((cfg.workdir / "mlartifacts").resolve())]
    # One worker: the UI of one person needs no more, and each worker is a whole MLflow app.
    return [*args, "--host", host, "--port", str(port), "--workers", "1"]


def local_store_path(uri: str) -> Path | None:
    """The file of a sqlite:/// store or the folder of a file: store; None for servers/DBs."""
    for prefix in ("sqlite:///", "file://"):
        if uri.startswith(prefix):
            return Path(uri[len(prefix) :].split("?", 1)[0])
    return None


def serve_ui(cfg: PipelineConfig, host: str, port: int) -> int:
    """Serve the MLflow UI on the pipeline's store until Ctrl-C (or point at a running server)."""
    from trainflow.tasks.tracking.config import resolve_tracking_uri

    uri = resolve_tracking_uri(cfg.tracking, cfg.workdir)
    if uri.startswith(("http://", "https://")):
        print(f"runs are on the MLflow tracking server {uri}: open {uri} (nothing to start)")
        return 0
    store = local_store_path(uri)
    if store is not None and not store.exists():
        raise ConfigError(
            f"no runs under {cfg.workdir} yet ({store} does not exist): run `trainflow run` "
            "first or pass --set workdir=<the workdir of your runs>"
        )
    check_port_free(host, port)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    print(f"MLflow UI on {uri}: http://{shown}:{port}  (Ctrl-C stops it)", flush=True)
    from trainflow.tasks.tracking.mlflow_server import serve

    # This process becomes `mlflow ui`: Ctrl-C and signals reach the server.
    serve(ui_args(cfg, port, host))


def check_port_free(host: str, port: int) -> None:
    """Fail with a clear message when the port is out of range or already taken."""
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port: pass one between 1 and 65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise ConfigError(
                f"cannot listen on {host}:{port} ({err.strerror}): pass another --port (or --host)"
            ) from None
