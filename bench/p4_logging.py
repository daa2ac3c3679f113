"""P4: training step time with MLflow logging over without (goal <= 1.02), per epoch and
every EVERY steps (train.log_every_steps: the epoch in segments, each window's metrics logged
and the journal flushed on the recorder's thread, as the job does).

Epochs with and without logging alternate in one process on the same Trainer, so both see
the same machine noise. The logger is the one the training job uses (per-epoch metrics
written to the job's journal at each flush), and the flow's relay that sends them (one
log_batch per poll) runs in the same process here, on the same 2 cores: against a SQLite
store and against a real `mlflow server`.
"""

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.steps import timed_epochs, trainer_for
from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.tracking.journal import Journal
from trainflow.tasks.tracking.logger import JournalLogger
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
from trainflow.tasks.train.checkpointing.recorder import EpochRecorder
from trainflow.tasks.train.config import TrainConfig

PAIRS = 12
"""Epochs of each arm, interleaved: with 6, the medians moved by 3% from run to run on this
2-core machine with other work on it."""
EVERY = 16
"""train.log_every_steps of the per-step arm: 4 logs an epoch of 64 steps (users log every
10 to 500 steps; more often costs more)."""


def _ratio(uri: str, workdir: Path, cfg: TrainConfig) -> tuple[float, float, float, float, float]:
    """(logged per epoch / plain, its step s, plain step s, logged every EVERY steps /
    plain, its step s)."""
    from trainflow.tasks.tracking.relay import Relay

    runs = PipelineRuns(TrackingConfig(tracking_uri=uri, experiment="bench-p4"), workdir, "p4")
    out = Path(tempfile.mkdtemp(dir=workdir))
    logger = JournalLogger(Journal(out, "rank0"))
    relay = Relay(out, runs.tracking_uri, runs.open_stage("train", {}), say=print)
    relay.start()

    def log(metrics: dict[str, float], epoch: int) -> None:
        logger.log(metrics, epoch)
        logger.flush()

    plain, logged, stepped = [], [], []
    with trainer_for(cfg) as (trainer, data), EpochRecorder() as recorder:

        def log_steps(metrics: dict[str, float], step: int) -> None:
            logger.log(metrics, step)  # as the job does (tasks.train.recipe)
            recorder.flush_when_idle(logger)

        timed_epochs(trainer, data, cfg, 1, lambda *_: None)  # warm-up
        for _ in range(PAIRS):
            plain += timed_epochs(trainer, data, cfg, 1, lambda *_: None)
            logged += timed_epochs(trainer, data, cfg, 1, log)
            stepped += timed_epochs(trainer, data, cfg, 1, log, EVERY, log_steps)
    relay.finish()
    a, b, c = statistics.median(logged), statistics.median(plain), statistics.median(stepped)
    return a / b, a, b, c / b, c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mlflow_server(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{workdir}/server.db",
            "--artifacts-destination",
            str(workdir / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("mlflow server did not start")


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Measure the logging overhead against SQLite and an HTTP tracking server."""
    cfg = TrainConfig()
    result: dict[str, Any] = {"config": cfg.model_dump(mode="json"), "pairs": PAIRS}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server, url = _mlflow_server(work)
        try:
            for name, uri in (("sqlite", f"sqlite:///{work}/bench.db"), ("http", url)):
                ratio, with_s, without_s, per_step, stepped_s = _ratio(uri, work, cfg)
                result[name] = {
                    "ratio": ratio,
                    "step_s_logged": with_s,
                    "step_s_plain": without_s,
                    "ratio_every_steps": per_step,
                    "step_s_logged_every_steps": stepped_s,
                    "log_every_steps": EVERY,
                }
                rows.append((f"step time logged/plain ({name})", f"{ratio:.3f}x", "<= 1.02"))
                rows.append(
                    (
                        f"step time logged every {EVERY} steps/plain ({name})",
                        f"{per_step:.3f}x",
                        "<= 1.02",
                    )
                )
                rows.append(
                    (
                        f"  step ms plain / logged ({name})",
                        f"{without_s * 1e3:.2f}/{with_s * 1e3:.2f}",
                        "",
                    )
                )
        finally:
            server.terminate()
            server.wait(timeout=30)
    return (
        "P4 logging overhead (median step time, per-epoch journal, relay in-process)",
        rows,
        result,
    )
