"""Where the suite spends its CPU: `pytest --cpu-report=FILE` (a pytest plugin, tests/conftest.py).

Each xdist worker (or the one pytest process) moves itself into a cgroup v1 `cpuacct` group of
its own, so every process a test starts (ranks, servers, dask workers, and a dev Slurm the worker
starts, with the jobs slurmd runs) is counted with it, whatever session it runs in. A test's CPU
is the group's `cpuacct.usage` after its teardown minus before its setup; the wall time is taken
alongside. Each worker writes its rows to FILE.<worker>.json; the controller merges them into
FILE (JSON) and prints the heaviest tests, the totals and how much of the wall time the CPUs were
busy. A dev Slurm already up when the run starts runs outside the groups: stop it first
(`trainflow cluster down`) to count its jobs. With --update-group-seconds it also rewrites
tests/group_seconds.json, which orders the test files longest first (tests/conftest.py).

The same tests' CPU differs between machines far more than any change to them does: the CPU
model differs (AMD EPYC Zen 1, 3 and 4 all ran this suite; `import torch` took 1.1-1.3 CPU s on
the Zen 4, 2.9-3.5 on the Zen 3), and one machine's speed moves 5-15% between runs. So the
report first measures a reference, the CPU seconds of `python -c "import torch"` (the suite's
commonest cost: every rank, server and command does it), the least of three, and prints and
saves it with the CPU's name beside the totals: compare runs by their CPU over that reference.

Needs root and a writable /sys/fs/cgroup/cpuacct; without them the report says so and the
tests run as usual.
"""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
GROUP_SECONDS = Path(__file__).with_name("group_seconds.json")
PARENT = CPUACCT / "trainflow-tests"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-report",
        metavar="FILE",
        default=None,
        help="write each test's CPU seconds (its processes' cgroup) and wall seconds to FILE",
    )
    parser.addoption(
        "--update-group-seconds",
        action="store_true",
        help=f"with --cpu-report: also rewrite {GROUP_SECONDS.name}, the test files' wall "
        "seconds that order them longest first",
    )


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _group() -> Path | None:
    """This worker's own cpuacct group, with this process in it; None where that can't be."""
    group = PARENT / f"{_worker()}-{os.getpid()}"
    try:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


def reference_cpu_s(repeats: int = 3) -> float:
    """The least CPU seconds (user + system) of `python -c "import torch"` over `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best = min(best, used)
    return round(best, 2)


def cpu_name() -> str:
    """The CPU's model name, family and model numbers and bf16 flags, from /proc/cpuinfo
    (without importing torch into the controller, as bench.common.machine_name would)."""
    from bench.common import cpuinfo_fields, x86_family_model

    fields = cpuinfo_fields()
    if not fields:
        return "unknown CPU"
    bf16 = sorted(set(fields.get("flags", "").split()) & {"avx512_bf16", "amx_bf16"})
    name = fields.get("model name", "unnamed CPU")
    return ", ".join(part for part in (name, x86_family_model(), " ".join(bf16)) if part) + (
        "" if bf16 else ", no native bf16"
    )


class CpuReport:
    """Per-test CPU and wall seconds of one worker's cgroup."""

    def __init__(self, path: Path, update_groups: bool = False) -> None:
        self.path = path
        self.update_groups = update_groups
        self.group = _group()
        self.rows: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.reference: dict[str, Any] | None = None
        if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller, before its workers start
            self.reference = {"cpu": cpu_name(), "import_torch_cpu_s": reference_cpu_s()}

    def _usage_s(self) -> float:
        assert self.group is not None
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        if self.group is None:
            yield
            return
        cpu0, wall0 = self._usage_s(), time.monotonic()
        yield
        cpu, wall = self._usage_s() - cpu0, time.monotonic() - wall0
        self.rows.append({"test": item.nodeid, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)})

    def pytest_sessionfinish(self) -> None:
        """Write this process's part (an xdist controller's has no tests, only its own CPU)."""
        part = self.path.with_name(f"{self.path.name}.{_worker()}.json")
        total = self._usage_s() if self.group is not None else None
        wall = time.monotonic() - self.started
        part.write_text(json.dumps({"rows": self.rows, "cpu_s": total, "wall_s": wall}))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if "PYTEST_XDIST_WORKER" in os.environ:
            return
        parts = sorted(self.path.parent.glob(f"{self.path.name}.*.json"))
        loaded = [json.loads(p.read_text()) for p in parts]
        rows = [row for part in loaded for row in part["rows"]]
        write = terminalreporter.write_line
        if not rows:
            write(f"cpu report: nothing measured (root and {CPUACCT} are needed)")
            return
        rows.sort(key=lambda r: -r["cpu_s"])
        report = {"reference": self.reference, "workers": loaded, "rows": rows}
        self.path.write_text(json.dumps(report, indent=1))
        cpu = sum(p["cpu_s"] or 0 for p in loaded)
        wall = time.monotonic() - self.started
        write(f"cpu report ({self.path}): {cpu:.0f} CPU s in {wall:.0f} s of wall time")
        write(f"  = {cpu / wall:.2f} CPUs busy on average out of {os.cpu_count()}")
        if self.reference:
            ref = self.reference["import_torch_cpu_s"]
            write(f"  on {self.reference['cpu']}: `import torch` took {ref} CPU s at the start")
            write(f"  (the run's CPU = {cpu / ref:.0f} such imports: compare runs by that)")
        for row in rows[:30]:
            write(f"  {row['cpu_s']:7.1f} CPU s {row['wall_s']:7.1f} s  {row['test']}")
        for p in parts:
            p.unlink()
        if self.update_groups:
            GROUP_SECONDS.write_text(json.dumps(group_seconds(rows), indent=1) + "\n")
            write(f"  wrote {GROUP_SECONDS} (the files' order in the next runs)")


def group_seconds(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Wall seconds per test file (an xdist group), longest first; files under a second left
    out (their order does not matter)."""
    per_file: dict[str, float] = {}
    for row in rows:
        name = row["test"].split("@")[0].split("::")[0]
        per_file[name] = per_file.get(name, 0.0) + row["wall_s"]
    ranked = sorted(per_file.items(), key=lambda kv: -kv[1])
    return {name: round(s, 1) for name, s in ranked if s >= 1.0}


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--cpu-report", default=None)
    if path:
        report = CpuReport(Path(path).resolve(), config.getoption("--update-group-seconds"))
        config.pluginmanager.register(report, "trainflow-cpu-report")
