"""P8: fixed costs of `trainflow run --preset tiny`, command to exit, cold (reported, no goal).

`python -m bench p8_fixed_costs` runs ROUNDS rounds (TRAINFLOW_BENCH_ROUNDS, default 3), each
launching the command twice, one after the other: against a running `prefect server start`
(started once before the rounds, PREFECT_API_URL set) and with Prefect's temporary server (no
PREFECT_API_URL). Each launch is a new process in a new folder, cold as in P7t (bench/p7t.py:
no dataset cache, a new MLflow store, an empty PREFECT_HOME and TRAINFLOW_CACHE; the temporary
server's database a copy of one at Prefect's head revision). Timed from the launch of the
process to its exit, with its CPU seconds (bench.timed); the medians are reported, and each
run's fixed costs are broken out from its own timestamped log (see `phases`).
"""

import ast
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.p7t import trainflow_argv
from bench.timed import (
    command_env,
    fresh_prefect_home,
    median,
    migrated_prefect_db,
    running_prefect_server,
    timed_command,
)

ROUNDS = int(os.environ.get("TRAINFLOW_BENCH_ROUNDS", "3"))
MODES = ("running server", "temporary server")
"""Against a running Prefect server, and with Prefect's temporary one."""

_DASK_INFO = re.compile(r"\| INFO +\| (distributed|dask_cuda)\.")
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d\d\d) \| ")
# (phase, the log line that ends it); each phase starts where the previous one ended.
_MARKS = (
    ("start-up and imports", "Starting temporary server|Beginning flow run"),
    ("temporary Prefect server", "Beginning flow run"),
    ("run set-up (flow, MLflow runs)", "MLflow parent run"),
    ("preprocess", "Task run 'preprocess"),
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


def tiny_run(folder: Path, api: str | None, database: Path) -> dict[str, Any]:
    """One cold `trainflow run --preset tiny` in the new `folder`: against the server at
    `api`, or with the temporary server when api is None."""
    work = folder / "work"
    work.mkdir(parents=True)
    extra = {"TRAINFLOW_CACHE": str(folder / "trainflow-cache")}
    if api is not None:
        env = command_env(fresh_prefect_home(folder, None), PREFECT_API_URL=api, **extra)
    else:
        env = command_env(fresh_prefect_home(folder, database), **extra)
    started = time.time()
    timed = timed_command(trainflow_argv("tiny", work), env, cwd=folder, timeout_s=600)
    if timed.returncode != 0:
        raise RuntimeError(f"trainflow run failed ({timed.returncode}):\n{timed.tail()}")
    lines = [x.rstrip("\n") for x in timed.lines]
    stage = next(x for x in lines if x.startswith("stage seconds"))
    return {
        "exit_s": round(timed.exit_s, 2),
        "cpu_s": round(timed.cpu_s, 2),
        "stages_s": ast.literal_eval(stage.split(None, 2)[2]),
        "phases_s": phases(lines, started, timed.exit_s),
        "dask_info_lines": sum(bool(_DASK_INFO.search(x)) for x in lines),
    }


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """ROUNDS interleaved rounds of the tiny preset in each mode; medians per mode."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-p8-") as tmp:
        root = Path(tmp)
        database = migrated_prefect_db(root / "prefect-template.db")
        with running_prefect_server(root / "server") as api:
            for i in range(ROUNDS):
                for j, mode in enumerate(MODES):
                    url = api if mode == "running server" else None
                    runs[mode].append(tiny_run(root / f"round{i}-{j}", url, database))
                    r = runs[mode][-1]
                    print(f"  round {i + 1}/{ROUNDS} {mode}: exit {r['exit_s']} s, "
                          f"{r['cpu_s']} CPU s", flush=True)  # fmt: skip
    medians = {
        mode: {
            "exit_s": median([r["exit_s"] for r in rs]),
            "cpu_s": median([r["cpu_s"] for r in rs]),
        }
        for mode, rs in runs.items()
    }
    result = {"runs": runs, "medians": medians}
    return "P8 `trainflow run --preset tiny`, command to exit, cold", _rows(result), result


def _rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for mode in MODES:
        m = result["medians"][mode]
        rows.append((f"{mode}: command to exit (CPU s)", f"{m['exit_s']} s ({m['cpu_s']})", ""))
        runs = result["runs"][mode]
        for phase in runs[0]["phases_s"]:
            value = median([r["phases_s"][phase] for r in runs])
            if value:
                rows.append((f"  median {phase}", f"{value:.2f} s", ""))
        info = max(r["dask_info_lines"] for r in runs)
        rows.append(("  dask INFO lines in the log (most of any run)", str(info), "0"))
    return rows
