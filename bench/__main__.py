"""Run the benchmarks: `python -m bench [NAME ...]` (default: all). Results go to
bench/results/<machine>.json; each benchmark prints its own table of medians and ratios."""

import importlib
import os
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
    "p7t",
    "p8_fixed_costs",
    "p8_profile",
    "p9_fsdp",
    "p10_fsdp_precision",
    "p11_search",
    "p12_stragglers",
    "p13_accumulation",
    "p14_mesh_memory",
]


def main(argv: list[str]) -> int:
    """Run the named benchmarks (all by default) one after another."""
    names = argv or BENCHES
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {BENCHES}", file=sys.stderr)
        return 2
    for name in names:
        start, load = time.perf_counter(), os.getloadavg()
        module = importlib.import_module(f"bench.{name}")
        title, rows, result = module.run()
        print(table(title, rows), flush=True)
        result |= {"wall_s": round(time.perf_counter() - start, 1)}
        path = save(name, result, command=f"python -m bench {name}", load_at_start=load)
        print(f"({name}: {time.perf_counter() - start:.0f} s, saved to {path})\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
