"""P8: fixed costs of `trainflow run --preset tiny`, from command to summary (goal: <= 10 s
against a running Prefect server, <= 20 s with Prefect's temporary one).

The command runs as a user runs it (a subprocess, preprocessing served by its cache, the
MLflow store and Prefect's database already created), once against a running `prefect server
start` and once with the temporary server. Each fixed cost is broken out from the run's own
timestamped log (see `phases`), and three are also measured on their own: the flow process's
imports, a dask cluster's start and stop (the cache skips it in these runs, not in a first
run), and the model export of the evaluate stage.
"""

import ast
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import median_seconds
from tests.services import prefect_server, service_env

_DASK_INFO = re.compile(r"\| INFO +\| (distributed|dask_cuda)\.")
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d\d\d) \| ")
# (phase, the log line that ends it); each phase starts where the previous one ended.
_MARKS = (
    ("start-up and imports", "Starting temporary server|Beginning flow run"),
    ("temporary Prefect server", "Beginning flow run"),
    ("run set-up (flow, MLflow runs)", "MLflow parent run"),
    ("preprocess (cached)", "Task run 'preprocess"),
    ("train: submit to rank 0 ready", r"\[rank0\] training "),
    ("train: first epoch", r"\[rank0\] epoch 1/"),
    ("train: other epochs, job end", "Task run 'train.*Finished"),
    ("evaluate", "Task run 'evaluate.*Finished"),
    ("summary artifact, flow end", "Flow run .* Finished"),
)


def _seconds_of_day(line: str) -> float | None:
    m = _STAMP.match(line)
    if m is None:
        return None
    h, mi, s, ms = (int(g) for g in m.groups())
    return h * 3600 + mi * 60 + s + ms / 1000


def phases(lines: list[str], started: float, wall: float) -> dict[str, float]:
    """Seconds of each phase of one run, from the log lines' timestamps (local time).

    `started` is the command's start (epoch seconds) and `wall` its whole duration; a phase
    whose end mark is missing (no temporary server against a running one) takes 0 s.
    """
    local = time.localtime(started)
    t = local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + started % 1
    out: dict[str, float] = {}
    for name, mark in _MARKS:
        hit = next((x for x in lines if re.search(mark, x) and _seconds_of_day(x) is not None), "")
        end = _seconds_of_day(hit)
        if end is None or end < t:
            out[name] = 0.0
            continue
        out[name], t = round(end - t, 2), end
    out["process exit (server stop, shutdown)"] = round(wall - sum(out.values()), 2)
    return out


def _trainflow(workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "trainflow.flows.cli", "run", "--preset", "tiny"]
    started = time.time()
    out = subprocess.run(
        [*argv, "--set", f"workdir={workdir}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    wall = time.time() - started
    if out.returncode != 0:
        raise RuntimeError(f"trainflow run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = (out.stdout + out.stderr).splitlines()
    stage = next(x for x in lines if x.startswith("stage seconds"))
    return {
        "wall_s": round(wall, 2),
        "stages_s": ast.literal_eval(stage.split(None, 2)[2]),
        "phases_s": phases(lines, started, wall),
        "dask_info_lines": sum(bool(_DASK_INFO.search(x)) for x in lines),
    }


def _import_seconds() -> float:
    """Wall time of a fresh process that imports the flow and its stages (what `trainflow
    run` loads)."""

    def once() -> None:
        code = "import flows.pipeline as p; p.import_stages()"
        subprocess.run([sys.executable, "-c", code], check=True)

    return median_seconds(once, repeats=2, warmup=0)


def _dask_seconds() -> float:
    from trainflow.cluster.config import DaskConfig
    from trainflow.cluster.dask import dask_client

    def once() -> None:
        with dask_client(DaskConfig()):
            pass

    return median_seconds(once, repeats=2, warmup=0)


def _export_seconds(folder: Path) -> float:
    """log_model of the tiny preset's model into a fresh run (the evaluate stage's export)."""
    import numpy as np
    from mlflow.tracking import MlflowClient

    from trainflow.flows.config import build_config
    from trainflow.tasks.evaluate.model_logging import log_model
    from trainflow.tasks.spec import image_classification
    from trainflow.tasks.train.model_plugins import build_model

    cfg = build_config("tiny", [])
    shape = (1, 16, 16)  # the synthetic source's images
    model = build_model(cfg.train, image_classification(shape, cfg.preprocess.synthetic_classes))
    uri = f"sqlite:///{folder}/export.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("p8", artifact_location=(folder / "art").as_uri())
    example = np.zeros((4, *shape), np.float32)

    def once() -> None:
        run = client.create_run(exp)
        log_model(model, example, uri, run.info.run_id)

    return median_seconds(once, repeats=2, warmup=1)


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """The tiny preset against a running Prefect server and with the temporary one."""
    result: dict[str, Any] = {"load_average_1min": [os.getloadavg()[0]]}
    with tempfile.TemporaryDirectory() as tmp:
        folder, workdir = Path(tmp), Path(tmp) / "work"
        db = f"sqlite+aiosqlite:///{folder}/prefect.db"
        with prefect_server(folder) as api:
            env = service_env(PREFECT_API_URL=api)
            _trainflow(workdir, env)  # builds the dataset and the MLflow store
            result["running_server"] = _trainflow(workdir, env)
        # The temporary server on the database the running one created (as on a second run);
        # the same PREFECT_HOME, so the same result storage serves preprocessing's cache.
        env = service_env(PREFECT_API_DATABASE_CONNECTION_URL=db)
        env.pop("PREFECT_API_URL", None)
        result["temporary_server"] = _trainflow(workdir, env)
        result["alone_s"] = {
            "imports of the flow process": round(_import_seconds(), 2),
            "dask cluster start and stop": round(_dask_seconds(), 2),
            "model export (log_model)": round(_export_seconds(folder), 2),
        }
    result["load_average_1min"].append(os.getloadavg()[0])
    return "P8 fixed costs of `trainflow run --preset tiny`", _rows(result), result


def _rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for key, goal in (("running_server", "<= 10 s"), ("temporary_server", "<= 20 s")):
        r = result[key]
        rows.append((f"command to summary, {key.replace('_', ' ')}", f"{r['wall_s']:.1f} s", goal))
        rows += [(f"  {k}", f"{v:.2f} s", "") for k, v in r["phases_s"].items() if v]
        rows.append(("  dask INFO lines in the log", str(r["dask_info_lines"]), "0"))
    rows += [(f"alone: {k}", f"{v:.2f} s", "") for k, v in result["alone_s"].items()]
    load = "/".join(f"{v:.1f}" for v in result["load_average_1min"])
    rows.append(("machine load, 1-min average at start/end", load, "2 cores: noisy above 2"))
    return rows
