"""P8 profile: where the seconds of one cold `trainflow run --preset tiny` go, and why.

`python -m bench p8_profile` launches the command three times, each cold as in P8
(bench/p8_fixed_costs.py: a new folder, a new MLflow store, no dataset cache, an empty
PREFECT_HOME and TRAINFLOW_CACHE):

1. against a running `prefect server start`, unprofiled: its phases from its own timestamped
   log (bench.p8_fixed_costs.phases);
2. with Prefect's temporary server, unprofiled: the same;
3. with the temporary server again, every Python process of it profiled: bench/profile_hook
   (a sitecustomize on PYTHONPATH) runs cProfile in each process from interpreter start-up to
   its exit (the command, the training job's controller, rank guards and ranks; not the
   temporary server's process, which Prefect ends with a signal). cProfile slows Python code
   (about 1.2-1.5x here), so this run's seconds say where time goes, not how long a run takes.

It also times `trainflow --help` and `trainflow config --preset tiny` (process launch to exit,
median of CLI_REPEATS alternated launches).

From the profiled run, per process: its seconds, the imports that cost the most (a package's
`__init__` module code, cumulative: what `python -X importtime` reports as its cumulative
time), the trainflow functions that cost the most (cumulative: where a cut would go) and
NAMED causes; for the command also the seconds from its launch to the profiler's start
(interpreter start-up) and from its atexit handlers to its exit (the interpreter's teardown).
"""

import json
import os
import pstats
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.p7t import trainflow_argv
from bench.p8_fixed_costs import tiny_run
from bench.timed import (
    command_env,
    fresh_prefect_home,
    median,
    migrated_prefect_db,
    running_prefect_server,
    timed_command,
)

REPO = Path(__file__).resolve().parent.parent
HOOK = REPO / "bench" / "profile_hook"
NAMED = (
    ("Prefect's temporary server start",
     r"prefect/server/api/server\.py:\d+\(start\)"),
    ("user code check (preflight)",
     r"flows/preflight\.py:\d+\(check_code\)"),
    ("new MLflow SQLite store (schema and migrations)",
     r"mlflow/store/db/utils\.py:\d+\(_initialize_tables\)"),
    ("waiting for the training job",
     r"cluster/jobs\.py:\d+\(wait_for_job\)"),
    ("evaluate stage",
     r"tasks/evaluate/run\.py:\d+\(run_evaluate\)"),
    ("model export and logging (mlflow.pytorch.log_model)",
     r"mlflow/pytorch/__init__\.py:\d+\(log_model\)"),
    ("figures (matplotlib)",
     r"tasks/objectives/classification\.py:\d+\(report\)"),
    ("torch._dynamo import (torch.optim, FlopCounterMode, torch.export)",
     r"torch/_dynamo/__init__\.py:1\(<module>\)"),
    ("FLOP count (torch.utils.flop_counter)",
     r"train/throughput\.py:\d+\(count_flops\)"),
    ("process group set-up",
     r"train/distributed\.py:\d+\(setup_distributed\)"),
    ("training epochs",
     r"train/job\.py:\d+\(_train\)"),
)  # fmt: skip
"""(cause, the profiled function that holds it): each reported with its cumulative seconds."""
CLI_REPEATS = 3
CLI_COMMANDS = {"--help": ["--help"], "config": ["config", "--preset", "tiny"]}
"""The commands a user runs without a pipeline, each timed on its own."""
_PACKAGE = re.compile(r"(?:site-packages|lib/python3\.\d+)/([A-Za-z_][\w]*)/__init__\.py$")
_WRAPPERS = re.compile(r"<frozen |runpy|contextlib|threading|/prefect/|/submitit/|rank_main")


def profiled_run(folder: Path, database: Path) -> dict[str, Any]:
    """One cold tiny run with the temporary server, every Python process profiled."""
    work, prof = folder / "work", folder / "profiles"
    work.mkdir(parents=True)
    prof.mkdir()
    path = os.pathsep.join(p for p in (str(HOOK), os.environ.get("PYTHONPATH", "")) if p)
    env = command_env(
        fresh_prefect_home(folder, database),
        TRAINFLOW_CACHE=str(folder / "trainflow-cache"),
        TRAINFLOW_BENCH_PROFILE=str(prof),
        PYTHONPATH=path,
    )
    launched = time.time()
    timed = timed_command(trainflow_argv("tiny", work), env, cwd=folder, timeout_s=600)
    if timed.returncode != 0:
        raise RuntimeError(f"profiled trainflow run failed ({timed.returncode}):\n{timed.tail()}")
    ended = launched + timed.exit_s
    processes = [summarise(facts, file, launched, ended) for facts, file in profiles(prof)]
    return {
        "exit_s": round(timed.exit_s, 2),
        "cpu_s": round(timed.cpu_s, 2),
        "processes": processes,
    }


def profiles(folder: Path) -> list[tuple[dict[str, Any], Path]]:
    """(facts, profile file) of each process that wrote one, in start order."""
    found = [(json.loads(f.read_text()), f.with_suffix(".prof")) for f in folder.glob("*.json")]
    return sorted((x for x in found if x[1].exists()), key=lambda x: x[0]["started"])


def role(facts: dict[str, Any]) -> str:
    """What the process is, from its argv (and rank)."""
    script = Path(facts["argv"][0]).name if facts["argv"] else "?"
    if script == "cli.py":
        return "command (trainflow run)"
    if script == "rank_main.py":
        return f"rank {facts.get('rank')}"
    return script.removesuffix(".py")


def summarise(facts: dict[str, Any], file: Path, launched: float, ended: float) -> dict[str, Any]:
    """One process's seconds, top imports, top trainflow functions and named causes."""
    # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    entries = pstats.Stats(str(file)).stats  # type: ignore[attr-defined]
    out: dict[str, Any] = {
        "process": role(facts),
        "profiled_s": round(facts["atexit"] - facts["started"], 2),
    }
    if out["process"].startswith("command"):
        out["launch_to_profiler_s"] = round(facts["started"] - launched, 2)
        out["atexit_to_exit_s"] = round(ended - facts["atexit"], 2)
    imports: dict[str, float] = {}
    for (path, _, name), value in entries.items():
        m = _PACKAGE.search(path) if name == "<module>" else None
        if m:
            imports[m[1]] = max(imports.get(m[1], 0.0), value[3])
    out["top_imports_s"] = _top(imports, 8)
    own = {
        f"{Path(path).parent.name}/{Path(path).name}:{name}": value[3]
        for (path, _, name), value in entries.items()
        if path.startswith(str(REPO)) and "site-packages" not in path
        if name != "<module>" and not _WRAPPERS.search(path)
    }
    # Leave out the entry points that hold the whole process (cli.main, the job's __call__).
    whole = 0.7 * out["profiled_s"]
    out["top_trainflow_functions_s"] = _top({k: v for k, v in own.items() if v < whole}, 10)
    named = {}
    for cause, pattern in NAMED:
        hits = [
            v[3] for (f, line, n), v in entries.items() if re.search(pattern, f"{f}:{line}({n})")
        ]
        if hits:
            named[cause] = round(max(hits), 2)
    out["named_causes_s"] = named
    return out


def _top(values: dict[str, float], n: int) -> dict[str, float]:
    best = sorted(values.items(), key=lambda kv: -kv[1])[:n]
    return {k: round(v, 2) for k, v in best if v >= 0.05}


def cli_seconds(folder: Path) -> dict[str, float | None]:
    """Launch to exit of each of CLI_COMMANDS, medians of CLI_REPEATS alternated launches."""
    env = command_env(fresh_prefect_home(folder, None))
    times: dict[str, list[float]] = {name: [] for name in CLI_COMMANDS}
    for _ in range(CLI_REPEATS):
        for name, args in CLI_COMMANDS.items():
            argv = [sys.executable, "-m", "trainflow.flows.cli", *args]
            timed = timed_command(argv, env, cwd=folder, timeout_s=120)
            if timed.returncode != 0:
                raise RuntimeError(f"trainflow {name} failed:\n{timed.tail()}")
            times[name].append(timed.exit_s)
    return {name: median(values) for name, values in times.items()}


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """The CLI's own seconds, the two unprofiled runs' phases and the profiled run's
    breakdown."""
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-p8p-") as tmp:
        root = Path(tmp)
        result["cli_s"] = cli_seconds(root)
        database = migrated_prefect_db(root / "prefect-template.db")
        with running_prefect_server(root / "server") as api:
            result["running server"] = tiny_run(root / "running", api, database)
        result["temporary server"] = tiny_run(root / "temporary", None, database)
        for mode in ("running server", "temporary server"):
            r = result[mode]
            print(f"  {mode}: exit {r['exit_s']} s, {r['cpu_s']} CPU s", flush=True)
        result["profiled"] = profiled_run(root / "profiled", database)
        print(f"  profiled: exit {result['profiled']['exit_s']} s", flush=True)
    return "P8 profile of one `trainflow run --preset tiny`, cold", rows(result), result


def rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The table: each mode's exit and phases, then the profiled run's causes per process."""
    out: list[tuple[str, str, str]] = [
        (f"trainflow {name}: launch to exit", f"{value} s", "<= 1 s")
        for name, value in result["cli_s"].items()
    ]
    for mode in ("running server", "temporary server"):
        r = result[mode]
        out.append((f"{mode}: command to exit (CPU s)", f"{r['exit_s']} s ({r['cpu_s']})", ""))
        out += [(f"  {k}", f"{v:.2f} s", "") for k, v in r["phases_s"].items() if v]
    p = result["profiled"]
    out.append(("profiled (temporary server): command to exit", f"{p['exit_s']} s", ""))
    for proc in p["processes"]:
        if not proc["named_causes_s"] and not proc["process"].startswith(("command", "rank")):
            continue
        out.append((f"  {proc['process']}: profiled", f"{proc['profiled_s']} s", ""))
        for key in ("launch_to_profiler_s", "atexit_to_exit_s"):
            if key in proc:
                out.append(
                    (f"    {key.removesuffix('_s').replace('_', ' ')}", f"{proc[key]} s", "")
                )
        out += [(f"    {k}", f"{v} s", "") for k, v in proc["named_causes_s"].items()]
        out += [
            (f"    import {k}", f"{v} s", "") for k, v in list(proc["top_imports_s"].items())[:4]
        ]
    return out


if __name__ == "__main__":
    from bench.common import table

    title, table_rows, _ = run()
    print(table(title, table_rows), file=sys.stdout)
