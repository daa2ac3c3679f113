"""The trainflow command's fast exit still does what a normal exit does first."""

import subprocess
import sys
from pathlib import Path

CODE = """
import atexit, sys, threading, time
from pathlib import Path
from trainflow.flows.cli import exit_fast
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.5)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(2)  # idle workers, never shut down: a normal exit stops them
pool.submit(int).result()
print("buffered line", end="")
exit_fast(3)
"""


def test_exit_fast_stops_threads_and_pools_runs_atexit_and_keeps_the_code(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CODE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered line"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"


def test_the_trainflow_command_is_the_fast_exit_entry() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["trainflow"] == "trainflow.flows.cli:entry"
