"""Shared benchmark helpers: timing medians, the machine's name, results files, tables."""

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def machine_name() -> str:
    """The GPU's name when CUDA is usable, else the CPU model and whether it computes bf16
    natively (what the results are about)."""
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    from trainflow.tasks.train.native_bf16 import cpu_bf16, this_cpu

    cpu = this_cpu()  # "AMD EPYC" names CPUs with and without bf16: results differ by 1.5x
    if cpu.model == "unnamed CPU":
        return platform.processor() or platform.machine()
    bf16 = "native bf16" if cpu_bf16(cpu)[0] else "no native bf16"
    if any(c.isdigit() for c in cpu.model):
        return f"{cpu.model} ({bf16})"
    # A hypervisor's generic name ("AMD EPYC" under KVM) names several generations: Zen 1, 3
    # and 4 all ran here, the first two without bf16 and 2.5x apart in speed. Their family and
    # model numbers tell them apart.
    return f"{cpu.model} {x86_family_model()} ({bf16})".replace("  ", " ")


def cpuinfo_fields() -> dict[str, str]:
    """/proc/cpuinfo's fields for its first processor ({} where it is unreadable); no torch."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_facts() -> dict[str, Any]:
    """The CPU as /proc/cpuinfo names it, its family and model, the cores this process may
    use, and whether it computes bf16 natively (what trainflow's precision policy reads)."""
    from trainflow.tasks.train.native_bf16 import cpu_bf16, this_cpu

    return {
        "model_name": cpuinfo_fields().get("model name", platform.processor()),
        "family_model": x86_family_model(),
        "cores": len(os.sched_getaffinity(0)),
        "native_bf16": cpu_bf16(this_cpu())[0],
    }


def x86_family_model() -> str:
    """'family 25 model 1' from /proc/cpuinfo's first processor ('' where it says neither)."""
    fields = cpuinfo_fields()
    family, model = fields.get("cpu family"), fields.get("model")
    return f"family {family} model {model}" if family and model else ""


def slug(text: str) -> str:
    """A file-name-safe form of a machine name."""
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of fn over `repeats` calls after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(title: str, rows: list[tuple[str, str, str]]) -> str:
    """A plain-text table of (measure, value, goal) rows."""
    width = max(len(r[0]) for r in rows)
    lines = [f"== {title} ==", f"{'measure'.ljust(width)}  {'value':>14}  goal"]
    lines += [f"{m.ljust(width)}  {v:>14}  {g}" for m, v, g in rows]
    return "\n".join(lines)


def save(name: str, result: dict[str, Any], command: str, load_at_start: tuple[float, ...]) -> Path:
    """Merge one benchmark's result into bench/results/<machine>.json, with the command that
    wrote it, the machine's 1/5/15-minute load averages when it started and at the end, the
    CPU model, whether it computes bf16 natively, and the time it was written."""
    machine = machine_name()
    path = RESULTS / f"{slug(machine)}.json"
    data = json.loads(path.read_text()) if path.exists() else {"machine": machine}
    data[name] = {
        **result,
        "command": command,
        "load_average_at_start": [round(v, 2) for v in load_at_start],
        "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
        "cpu": cpu_facts(),
        "written": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path
