"""Fixed costs of a tiny run that were cut at their source (bench/p8_profile.py measures them):
each test fails when the cost comes back, by what is imported or done, never by a timing."""

import gc
import importlib.util
import subprocess
import sys

import pytest

_LIGHTNING = """
import importlib.util, sys
from trainflow.compat import import_mlflow_pytorch
module = import_mlflow_pytorch()
assert callable(module.log_model) and callable(module.load_model)
heavy = sorted(m for m in ("pytorch_lightning", "lightning", "torchmetrics", "transformers")
               if m in sys.modules)
assert not heavy, heavy
# The block is lifted: Lightning is findable again (a None left in sys.modules would raise).
assert importlib.util.find_spec("pytorch_lightning") is not None
print("ok")
"""


@pytest.mark.services
@pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None, reason="Lightning is not installed"
)
def test_the_evaluate_stages_mlflow_pytorch_leaves_lightning_unimported() -> None:
    """Where Lightning is installed, mlflow.pytorch's import would load it, torchmetrics and
    transformers (trainflow.compat.import_mlflow_pytorch). ~4 s: one process imports MLflow."""
    out = subprocess.run(
        [sys.executable, "-c", _LIGHTNING], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-2000:]


def test_the_command_collects_less_and_freezes_its_heap_before_the_teardown(monkeypatch) -> None:
    """`trainflow` collects its youngest generation every 10,000 allocations, not Python's 700
    (the collections walk the imports' millions of objects), and leaves its objects out of the
    exit's garbage collections (gc.freeze), which otherwise take seconds; ~0.1 s."""
    from trainflow.flows.cli import entry

    before = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)  # Python's default
    monkeypatch.setattr(sys, "argv", ["trainflow", "presets"])
    try:
        with pytest.raises(SystemExit) as ended:
            entry()
        assert ended.value.code == 0
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (10_000, 10, 10)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


_PENDING = """
import atexit, logging, sys, threading, time
from trainflow import gc_policy

out = sys.argv[1]
logging.basicConfig(filename=out + ".log", level=logging.INFO)
def sender():  # a thread still sending when the command's work ends
    time.sleep(0.3)
    with open(out + ".thread", "w") as f:
        f.write("sent")
def flush_at_exit():  # as Prefect's log and event workers and MLflow's async logging do
    time.sleep(0.2)
    with open(out + ".atexit", "w") as f:
        f.write("flushed")
threading.Thread(target=sender).start()
atexit.register(flush_at_exit)
logging.getLogger("trainflow").info("last line")
gc_policy.before_exit()
"""


def test_the_exit_still_waits_for_data_not_yet_written(tmp_path) -> None:
    """Freezing the heap skips the teardown's collections only: a thread still sending, an
    atexit flush and the log's last line all land before the process ends; ~0.6 s."""
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", _PENDING, str(out)], check=True, timeout=60)
    assert (tmp_path / "out.thread").read_text() == "sent"
    assert (tmp_path / "out.atexit").read_text() == "flushed"
    assert "last line" in (tmp_path / "out.log").read_text()
