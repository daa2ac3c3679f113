"""Run the benchmarks: `python -m bench [NAME ...]` (default: all). Results go to
bench/results/<machine>.json; each benchmark prints its own table of medians and ratios."""

import importlib
import sys
import time

from bench.common import save, table

BENCHES = [
    "p1_training",
    "p2_preprocess",
    "p2j_decode",
    "p3_orchestration",
    "p4_logging",
    "p5_checkpoint",
    "p6_gpu",
    "p7_lightning",
    "p8_fixed_costs",
    "p9_fsdp",
    "new_store",  # P10: a new tracking store without a sync per migration
    "first_result",  # P7 and P8 from the command, with CPU seconds (issue 18 point 1)
]
OPTIONAL = ["cold_start"]
"""Known but not run by default (`python -m bench cold_start`)."""


def main(argv: list[str]) -> int:
    """Run the named benchmarks (all by default) one after another."""
    names = argv or BENCHES
    unknown = sorted(set(names) - set(BENCHES) - set(OPTIONAL))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {BENCHES + OPTIONAL}", file=sys.stderr)
        return 2
    for name in names:
        start = time.perf_counter()
        module = importlib.import_module(f"bench.{name}")
        title, rows, result = module.run()
        print(table(title, rows), flush=True)
        path = save(name, {**result, "wall_s": round(time.perf_counter() - start, 1)})
        print(f"({name}: {time.perf_counter() - start:.0f} s, saved to {path})\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
