"""cluster.executor=allocation on the 2-node dev cluster: inside one sbatch job over both
nodes (tests/slurm/allocation_driver.py), a lost rank ends its step and the restart is a new
step away from the lost node; a cancel (Ctrl-C in the watcher, or `trainflow cleanup`'s
registry cancel) ends the step, and no rank is left on any node in either case."""

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(records: list[dict[str, object]]) -> list[int]:
    """Every rank and guard pid the records name."""
    return [int(str(r[k])) for r in records for k in ("pid", "guard_pid")]


def test_allocation_steps_restart_after_a_lost_rank_and_cancel_without_leaving_ranks(
    tmp_path: Path,
) -> None:
    argv = ["sbatch", "--wait", "--nodes=2", "--ntasks=2", "--cpus-per-task=2", "--time=10"]
    argv += [f"--chdir={REPO}", f"--output={tmp_path}/job.out", "--wrap"]
    argv += [f"{sys.executable} -m tests.slurm.allocation_driver {tmp_path}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=560)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{log[-4000:]}"
    results = json.loads((tmp_path / "results.json").read_text())

    # A lost rank: named with its node; the restart is a new step on the other node.
    restart = results["restart"]
    lost_node = restart["killed"]["slurm_node"]
    assert lost_node == "tfnode1"  # a 1-node step starts on the job's first node
    assert "lost rank 1 (node tfnode1)" in restart["warnings"][0], restart["warnings"]
    lines = "\n".join(restart["lines"])
    assert "excluding node(s) tfnode1" in lines, lines[-3000:]
    ids = re.findall(r"submitted training job (\S+) \(allocation executor\)", lines)
    assert len(ids) == 2 and len(set(ids)) == 2, ids
    assert {r["slurm_node"] for r in restart["records"] if r["job"] == ids[1]} == {"tfnode2"}
    assert "[rank0@tfnode2] " in lines
    assert torch.load(restart["checkpoint"], weights_only=True)["model"]

    # Cancels: the step ends, every rank on both nodes with it.
    for how in ("ctrl_c", "cleanup"):
        case = results[how]
        assert case["seen"], f"{how}: training never reached epoch 2"
        assert sorted(r["slurm_node"] for r in case["records"]) == ["tfnode1", "tfnode2"]
        assert case["srun_ended"] and case["steps_left"] == [], case
        assert not [p for p in _pids(case["records"]) if _alive(p)], f"{how}: a rank outlived"
    assert results["ctrl_c"]["error"] == "KeyboardInterrupt"
    # A scancelled step is no lost rank: never restarted (like a scancelled Slurm job).
    assert results["cleanup"]["error"].startswith("JobError: "), results["cleanup"]["error"]
    assert not [p for p in _pids(restart["records"]) if _alive(p)], "a rank outlived its step"
    # A step srun refuses fails at once with srun's reason, not a wait for result files.
    assert "before any rank started; srun said" in results["refused"], results["refused"]
    assert "More processors requested than permitted" in results["refused"]
