"""P7t: process start to test accuracy, `trainflow run --preset demo` against the same recipe
written for PyTorch Lightning (bench/p7_lightning.py), both cold, side by side in one run.
Goal: trainflow at most 0.6x Lightning's time with a running Prefect server, at most 1.0x with
Prefect's temporary server.

`python -m bench p7t` runs ROUNDS rounds (TRAINFLOW_BENCH_ROUNDS, default 3), each launching,
one after another: the Lightning script, trainflow against a running Prefect server, trainflow
with Prefect's temporary server. The tables give medians over the rounds and their ratios.

- lightning: `python -m bench.p7_lightning RECIPE WORKDIR`;
- trainflow, running server: `python -m trainflow.flows.cli run --preset demo --set
  workdir=WORKDIR` with PREFECT_API_URL naming a `prefect server start` on a free loopback
  port, started once before the rounds (as a user's server runs before their command);
- trainflow, temporary server: the same command without PREFECT_API_URL (Prefect starts its
  temporary server inside the command and stops it at the end).

The same on both sides: the data (the bundled MNIST subset, the same train/val/test members:
checked here by a digest of the test split's samples), the demo's model, epochs (8), AdamW
settings, per-step cosine over all epochs, batch size per rank, ranks (2 DDP ranks on CPU),
threads per rank, precision (trainflow's `auto`: bf16 autocast on CPUs with native bf16, else
fp32; Lightning gets the same through PRECISION), weights tested (the best epoch by
validation accuracy) and metric (accuracy on the 500-sample test split).

The event, the same for both: the launch of the process (the clock starts just before it is
created) to its first output line `test accuracy X` (bench.timed.TEST_ACCURACY). trainflow's
rank 0 prints it as training ends, before its evaluate stage (plots, model export, model
registration) runs; the Lightning script prints it after `Trainer.test`. A run reaches TARGET
only if X >= TARGET. Process exit is timed too and reported beside it: trainflow's exit comes
after the evaluate stage and MLflow work that the Lightning script does not do.

What is cold: every run is new processes (imports, DDP ranks, dask workers, the temporary
server) in a new folder: no dataset cache (trainflow preprocesses the raw data), a new MLflow
SQLite store, new checkpoints, an empty PREFECT_HOME (no Prefect result cache) and an empty
TRAINFLOW_CACHE. Not cold: the operating system's page cache (the installed packages' files,
the same for every run) and the Prefect database: the running server's, and for the temporary
server a copy, in each run's PREFECT_HOME, of a database already at Prefect's head revision,
as a user has it after their first Prefect run (a first-ever run also creates its tables).

CPU seconds: the launched process's and its reaped descendants' (bench.timed); the running
Prefect server's work on a run's behalf is not in them.
"""

import ast
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.timed import (
    TEST_ACCURACY,
    Timed,
    command_env,
    fresh_prefect_home,
    median,
    migrated_prefect_db,
    running_prefect_server,
    timed_command,
)

TARGET = 0.95
"""The test accuracy a run must reach."""
ROUNDS = int(os.environ.get("TRAINFLOW_BENCH_ROUNDS", "3"))
SIDES = ("lightning", "trainflow running server", "trainflow temporary server")
GOALS = {"trainflow running server": 0.6, "trainflow temporary server": 1.0}
"""Goal: at most this many times Lightning's median time to the event."""
REPO = Path(__file__).resolve().parent.parent


def trainflow_argv(preset: str, workdir: Path) -> list[str]:
    """`trainflow run --preset <preset>` as an ordinary process, writing into workdir."""
    return [sys.executable, "-m", "trainflow.flows.cli", "run", "--preset", preset,
            "--set", f"workdir={workdir}"]  # fmt: skip


def side_run(side: str, folder: Path, api: str, database: Path, recipe: dict[str, Any]) -> Timed:
    """Launch one side in the new `folder` and time it to the test accuracy line and exit."""
    work = folder / "work"
    work.mkdir(parents=True)
    extra = {"TRAINFLOW_CACHE": str(folder / "trainflow-cache")}
    if side == "lightning":
        env = command_env(fresh_prefect_home(folder, None), PYTHONPATH=str(REPO), **extra)
        argv = [sys.executable, "-m", "bench.p7_lightning", json.dumps(recipe), str(work)]
    elif side == "trainflow running server":
        env = command_env(fresh_prefect_home(folder, None), PREFECT_API_URL=api, **extra)
        argv = trainflow_argv("demo", work)
    else:
        env = command_env(fresh_prefect_home(folder, database), **extra)
        argv = trainflow_argv("demo", work)
    return timed_command(argv, env, TEST_ACCURACY, cwd=folder)


def record(side: str, timed: Timed, work: Path) -> dict[str, Any]:
    """One run's figures; raises with the output's tail when the command never printed its
    test accuracy. A side that printed it and then failed at its exit (Lightning's process has
    aborted in its teardown: SIGABRT, "terminate called without an active exception") is
    recorded, timed to its result line, with its exit status."""
    if timed.event is None or timed.event_s is None:
        raise RuntimeError(f"{side} failed ({timed.returncode}):\n{timed.tail()}")
    accuracy = float(timed.event)
    out: dict[str, Any] = {
        "to_test_accuracy_s": round(timed.event_s, 2) if accuracy >= TARGET else None,
        "test_accuracy": accuracy,
        "exit_s": round(timed.exit_s, 2),
        "cpu_s": round(timed.cpu_s, 2),
        "returncode": timed.returncode,
    }
    if side == "lightning":
        facts = next((x for x in timed.lines if x.startswith("p7-lightning ")), None)
        if facts is not None:
            out |= {k: v for k, v in json.loads(facts.split(None, 1)[1]).items() if k != "ended"}
    else:
        banner = next((x for x in timed.lines if "[rank0] training " in x), "")
        out["banner"] = banner.split("[rank0] ", 1)[-1].strip()
        out["test_digest"] = trainflow_test_digest(work)
        # The summary's stage seconds (the evaluate stage's among them), where it printed one.
        stages = next((x for x in timed.lines if x.startswith("stage seconds")), None)
        if stages is not None:
            out["stages_s"] = ast.literal_eval(stages.split(None, 2)[2])
    return out


def trainflow_test_digest(workdir: Path) -> str:
    """The digest of the test split's samples in the dataset trainflow wrote under workdir."""
    from bench.p7_lightning import samples_digest
    from trainflow.tasks.preprocess.dataset import load_raw_split

    manifest = next((workdir / "datasets").glob("*/manifest.json"))
    x, y = load_raw_split(manifest.parent, "test")
    return samples_digest(x, y)


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """ROUNDS interleaved rounds of the three sides; medians, ratios and the checks."""
    from bench.p7_lightning import demo_recipe

    recipe = demo_recipe()
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-p7t-") as tmp:
        root = Path(tmp)
        database = migrated_prefect_db(root / "prefect-template.db")
        with running_prefect_server(root / "server") as api:
            for i in range(ROUNDS):
                for j, side in enumerate(SIDES):
                    folder = root / f"round{i}-{j}"
                    timed = side_run(side, folder, api, database, recipe)
                    runs[side].append(record(side, timed, folder / "work"))
                    print(f"  round {i + 1}/{ROUNDS} {side}: {summary(runs[side][-1])}", flush=True)
    result = summarise(runs)
    result["recipe"] = recipe
    return (
        "P7t process start to test accuracy: trainflow vs Lightning, both cold",
        rows(result),
        result,
    )


def summary(r: dict[str, Any]) -> str:
    """One run in a line, printed as the rounds go."""
    failed = f" (exit status {r['returncode']})" if r.get("returncode") else ""
    return (f"test accuracy {r['test_accuracy']:.4f} at {r['to_test_accuracy_s']} s, "
            f"exit {r['exit_s']} s{failed}, {r['cpu_s']} CPU s")  # fmt: skip


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per side, ratios against Lightning, and whether the test sets were the same."""
    medians = {
        side: {
            key: median([r[key] for r in rs]) for key in ("to_test_accuracy_s", "exit_s", "cpu_s")
        }
        for side, rs in runs.items()
    }
    lit = medians["lightning"]
    ratios = {side: {key: _ratio(medians[side][key], lit[key]) for key in lit} for side in GOALS}
    digests = {r.get("test_digest") for rs in runs.values() for r in rs}  # None: not printed
    return {
        "runs": runs,
        "medians": medians,
        "ratios_to_lightning": ratios,
        "goals": GOALS,
        "target": TARGET,
        "same_test_set": len(digests) == 1 and None not in digests,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The table: each side's medians, then each trainflow mode's ratios and goal."""
    out = []
    for side, m in result["medians"].items():
        out.append((f"{side}: to test acc >= {TARGET} / exit / CPU s",
                    f"{m['to_test_accuracy_s']} / {m['exit_s']} / {m['cpu_s']}", ""))  # fmt: skip
    for side, goal in GOALS.items():
        r = result["ratios_to_lightning"][side]
        out.append((f"ratio {side} / lightning, to test acc", str(r["to_test_accuracy_s"]),
                    f"<= {goal}x"))  # fmt: skip
        out.append((f"ratio {side} / lightning, to exit", str(r["exit_s"]), ""))
        out.append((f"ratio {side} / lightning, CPU s", str(r["cpu_s"]), ""))
        evaluate = median([x.get("stages_s", {}).get("evaluate") for x in result["runs"][side]])
        out.append((f"{side}: evaluate stage (median)", f"{evaluate} s", "<= 2 s"))
    out.append(("same test set on every run", str(result["same_test_set"]), "True"))
    return out
