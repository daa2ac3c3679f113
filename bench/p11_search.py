"""P11: a pruned search against the same grid trained to the end, side by side in one run.

Both sides are `trainflow sweep --space ...` as a user runs it (the local executor, a new
process in a new folder: no dataset cache, a new MLflow store and Optuna study, an empty
PREFECT_HOME holding a Prefect database at its head revision, as in P8), on the demo data
(`--preset demo`) with the resnet (`train.model=resnet`: the demo's reference CNN has no
width), over the same grid of lr x width x batch size (Optuna's GridSampler, `--seed 0`, one
trial at a time on two ranks, so both sides draw the points in the same order), the same
epochs and precision (`auto`). The unpruned side (`--pruner none`) trains every point to the
end; the pruned side uses the product's default pruner (`--pruner asha`).

What is counted, per side:
- best validation accuracy: the best complete trial's value (what the search evaluates);
- epochs: every trial's intermediate values in the study it leaves (one per epoch trained: a
  trial pruned after epoch N reported N);
- CPU seconds of the array: user + system time of the array's processes (submitit's local
  controller and the rank processes under it, which train every trial), read from /proc every
  SAMPLE_S (up to SAMPLE_S of each process's last moments unseen);
- CPU seconds of the command: its wait4 rusage, every descendant included (Prefect's
  temporary server, MLflow, preprocessing and the evaluation of the best trial: fixed costs
  both sides pay alike);
- trial seconds: the sum of Optuna's start-to-end times of the trials.

Goal: the pruned side's best within 0.5 points of the unpruned side's, for at most 40% of its
epochs.
"""

import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.p11_replay import REPLAYED, replay

SPACE = (
    "train.lr=choice(0.001,0.003,0.01,0.03)",
    "train.width=choice(4,8)",
    "train.batch_size=choice(64,128)",
)
"""16 points: learning rate x the resnet's width x batch size."""
EPOCHS = 6
"""Epochs of every trial (the demo's 8 would take the benchmark past 15 minutes here)."""
OVERRIDES = ("train.model=resnet", f"train.epochs={EPOCHS}")
SEED = 0
"""The grid sampler's seed: the order in which both sides draw the points."""
SIDES = {"unpruned": "none", "pruned": "asha"}
"""Side -> --pruner."""
SAMPLE_S = 0.5
EPOCH_LINE = re.compile(r"rank0\] epoch \d+/\d+ ")
"""Rank 0's line for each epoch trained, in the command's output (a check on the study's
count)."""
GOAL_POINTS = 0.5
GOAL_EPOCH_SHARE = 0.40


def sweep_argv(
    workdir: Path,
    pruner: str,
    preset: str = "demo",
    overrides: tuple[str, ...] = OVERRIDES,
    space: tuple[str, ...] = SPACE,
) -> list[str]:
    """`trainflow sweep --space ...` over the whole grid of `space`, one trial at a time."""
    trials = 1
    for text in space:
        trials *= len(text.partition("(")[2].rstrip(")").split(","))
    argv = [sys.executable, "-m", "trainflow.flows.cli", "sweep", "--preset", preset]
    for item in (f"workdir={workdir}", *overrides):
        argv += ["--set", item]
    for text in space:
        argv += ["--space", text]
    argv += ["--sampler", "grid", "--seed", str(SEED), "--pruner", pruner]
    return [*argv, "--trials", str(trials), "--parallel", "1"]


class ArrayCpu:
    """User + system CPU seconds of the search array's processes under `workdir`: submitit's
    local controller (its command line names the workdir's jobs folder) and its descendants,
    each process's last reading kept, read every SAMPLE_S on a thread."""

    def __init__(self, workdir: Path) -> None:
        self.mark = f"{workdir}/"
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "ArrayCpu":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        """CPU seconds of every array process seen so far."""
        return sum(self.seen.values())

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        """Read the CPU time of every array process now."""
        import psutil

        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if "submitit.local._local" not in cmdline or self.mark not in cmdline:
                continue
            try:
                family = [proc, *proc.children(recursive=True)]
            except psutil.Error:
                continue
            for member in family:
                try:
                    with member.oneshot():
                        t = member.cpu_times()
                        key = (member.pid, member.create_time())
                except psutil.Error:
                    continue  # it ended between the listing and the reading
                self.seen[key] = max(self.seen.get(key, 0.0), t.user + t.system)


def study_trials(workdir: Path) -> list[dict[str, Any]]:
    """The trials of the one study in `workdir`/optuna.db that were trained, in order: their
    values, state, epochs reported and start-to-end seconds."""
    import optuna

    from trainflow.tasks.search.study import OVER_BUDGET_ATTR, quiet_optuna

    quiet_optuna()
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    (name,) = optuna.get_all_study_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    out = []
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(OVER_BUDGET_ATTR) or not t.state.is_finished():
            continue
        took = (
            t.datetime_complete - t.datetime_start
            if t.datetime_start and t.datetime_complete
            else None
        )
        out.append(
            {
                "number": t.number,
                "params": t.params,
                "state": t.state.name,
                "value": t.value,
                "curve": [t.intermediate_values[k] for k in sorted(t.intermediate_values)],
                "epochs": len(t.intermediate_values),
                "seconds": round(took.total_seconds(), 2) if took else None,
            }
        )
    return out


def side(folder: Path, pruner: str, database: Path | None, **sweep: Any) -> dict[str, Any]:
    """One cold `trainflow sweep` in the new `folder` with `--pruner pruner`: its trials and
    what they cost. `sweep`: sweep_argv's preset, overrides and space."""
    import os

    from bench.timed import command_env, fresh_prefect_home, timed_command

    work = folder / "work"
    work.mkdir(parents=True)
    env = command_env(
        fresh_prefect_home(folder, database), TRAINFLOW_CACHE=str(folder / "trainflow-cache")
    )
    load = os.getloadavg()
    with ArrayCpu(work) as array:
        timed = timed_command(sweep_argv(work, pruner, **sweep), env, cwd=folder, timeout_s=1800)
    if timed.returncode != 0:
        raise RuntimeError(f"trainflow sweep failed ({timed.returncode}):\n{timed.tail()}")
    trials = study_trials(work)
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    best = max(complete, key=lambda t: (t["value"], -t["number"]))
    return {
        "pruner": pruner,
        "trials": trials,
        "best": {k: best[k] for k in ("number", "params", "value")},
        "epochs": sum(t["epochs"] for t in trials),
        "epoch_lines": sum(bool(EPOCH_LINE.search(line)) for line in timed.lines),
        "states": {s: sum(t["state"] == s for t in trials) for s in {t["state"] for t in trials}},
        "array_cpu_s": round(array.seconds, 2),
        "command_cpu_s": round(timed.cpu_s, 2),
        "exit_s": round(timed.exit_s, 2),
        "trial_s": round(sum(t["seconds"] or 0.0 for t in trials), 2),
        "load_average_at_start": [round(v, 2) for v in load],
    }


def summarise(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Both sides with the comparisons: the pruned side's best against the unpruned one's
    (points), its epochs and CPU seconds over the unpruned side's, and whether the goal is
    met."""
    full, pruned = sides["unpruned"], sides["pruned"]
    order = [t["params"] for t in full["trials"]]
    points = 100 * (pruned["best"]["value"] - full["best"]["value"])
    share = pruned["epochs"] / full["epochs"]

    def ratio(key: str) -> float:
        return round(pruned[key] / full[key], 3) if full[key] else float("nan")

    unpruned_curves = {json.dumps(t["params"], sort_keys=True): t["curve"] for t in full["trials"]}
    same_curves = all(
        unpruned_curves.get(json.dumps(t["params"], sort_keys=True), [])[: len(t["curve"])]
        == t["curve"]
        for t in pruned["trials"]
    )
    return {
        "sides": sides,
        "same_points_same_order": order == [t["params"] for t in pruned["trials"]],
        "same_values_until_pruned": same_curves,
        "best_difference_points": round(points, 2),
        "epoch_share": round(share, 3),
        "array_cpu_ratio": ratio("array_cpu_s"),
        "command_cpu_ratio": ratio("command_cpu_s"),
        "trial_seconds_ratio": ratio("trial_s"),
        "goal_met": points >= -GOAL_POINTS and share <= GOAL_EPOCH_SHARE,
    }


def rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The table: each measure unpruned / pruned, and the ratios."""
    full, pruned = result["sides"]["unpruned"], result["sides"]["pruned"]

    def both(key: str, fmt: str = "{}") -> str:
        return f"{fmt.format(full[key])} / {fmt.format(pruned[key])}"

    best = f"{full['best']['value']:.4f} / {pruned['best']['value']:.4f}"
    states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(pruned["states"].items()))
    goal_points = f">= -{GOAL_POINTS}"
    return [
        ("best val accuracy, unpruned / pruned", best, ""),
        ("  difference (points)", f"{result['best_difference_points']:+.2f}", goal_points),
        ("  best trial's params, unpruned", str(full["best"]["params"]), ""),
        ("  best trial's params, pruned", str(pruned["best"]["params"]), ""),
        ("epochs trained, unpruned / pruned", both("epochs"), ""),
        ("  pruned / unpruned", f"{result['epoch_share']:.3f}", f"<= {GOAL_EPOCH_SHARE}"),
        ("  pruned side's trials", states, ""),
        ("array CPU s, unpruned / pruned", both("array_cpu_s", "{:.1f}"), ""),
        ("  pruned / unpruned", f"{result['array_cpu_ratio']:.3f}", ""),
        ("trial seconds (Optuna), unpruned / pruned", both("trial_s", "{:.1f}"), ""),
        ("  pruned / unpruned", f"{result['trial_seconds_ratio']:.3f}", ""),
        ("command CPU s (fixed costs incl.)", both("command_cpu_s", "{:.1f}"), ""),
        ("  pruned / unpruned", f"{result['command_cpu_ratio']:.3f}", ""),
        ("command wall s, unpruned / pruned", both("exit_s", "{:.1f}"), ""),
        ("same points in the same order", str(result["same_points_same_order"]), "True"),
        ("same values until pruned", str(result["same_values_until_pruned"]), "True"),
        ("goal met", "yes" if result["goal_met"] else "no", "yes"),
        *replay_rows(result.get("replay", {})),
    ]


def replay_rows(replays: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    """One block per pruner replayed over the unpruned side's curves (bench.p11_replay)."""
    out = []
    for name, r in replays.items():
        out.append((f"replayed, {r['orders']} orders: {name}", "", ""))
        out.append(("  orders meeting the goal", f"{100 * r['goal_met_share']:.0f}%", ""))
        out.append(
            ("  orders keeping the best within 0.5", f"{100 * r['best_kept_share']:.0f}%", "")
        )
        share = f"{r['epoch_share_median']:.3f} / {r['epoch_share_max']:.3f}"
        out.append(("  epoch share, median / largest", share, ""))
        out.append(("  points to the best, worst", f"{r['difference_points_worst']:+.2f}", ""))
    return out


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Both sides, unpruned first, each cold in its own folder."""
    from bench.timed import migrated_prefect_db

    sides: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-p11-") as tmp:
        root = Path(tmp)
        database = migrated_prefect_db(root / "prefect-template.db")
        for name, pruner in SIDES.items():
            start = time.perf_counter()
            sides[name] = side(root / name, pruner, database)
            s = sides[name]
            print(f"  {name} (--pruner {pruner}): best {s['best']['value']:.4f}, "
                  f"{s['epochs']} epochs, array {s['array_cpu_s']} CPU s, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    result = summarise(sides)
    curves = [t["curve"] for t in sides["unpruned"]["trials"]]
    result["replay"] = {
        name: replay(curves, make, GOAL_POINTS, GOAL_EPOCH_SHARE) for name, make in REPLAYED.items()
    }
    result |= {
        "preset": "demo",
        "overrides": list(OVERRIDES),
        "space": list(SPACE),
        "seed": SEED,
        "parallel": 1,
        "ranks_per_trial": 2,
    }
    title = f"P11 pruned search (--pruner asha) against the same grid unpruned, {EPOCHS} epochs"
    return title, rows(result), result
