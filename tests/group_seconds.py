"""Refresh tests/group_seconds.json (the test files' order in a parallel run, tests/conftest.py)
from a run's JUnit report: `make group-seconds` after `make test`, on a quiet machine.

Each file's seconds are the sum of its tests' durations (set-up and tear-down included, as
pytest's JUnit report counts them), rounded to a tenth."""

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TARGET = Path(__file__).with_name("group_seconds.json")


def file_seconds(report: Path) -> dict[str, float]:
    """Seconds per test file of the JUnit `report`, longest first."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        parts = [p for p in module if not p[:1].isupper()]  # drop a test class's name
        if parts:
            totals["/".join(parts) + ".py"] += float(case.get("time", 0.0))
    return dict(sorted(((k, round(v, 1)) for k, v in totals.items()), key=lambda kv: -kv[1]))


def main(argv: list[str]) -> int:
    """Write the seconds of the report named by argv[0] into group_seconds.json."""
    seconds = file_seconds(Path(argv[0]))
    TARGET.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{TARGET}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
