"""tasks.import_gc: the collector paused for imports, back as it was after the last pause (on
any thread), and in a child forked during one; what was imported frozen (never traversed
again), with or without a collection first, and everything frozen at exit; cluster.rank_main
runs a job as submitit's own entry would, frozen."""

import gc
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainflow.tasks.import_gc import imports_without_gc

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_in_the_block_and_back_after_it_even_on_an_error() -> None:
    with imports_without_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError), imports_without_gc():
        import no_such_module_anywhere  # noqa: F401
    assert gc.isenabled()


def test_pauses_on_two_threads_end_with_the_last() -> None:
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with imports_without_gc():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with imports_without_gc():
        release.set()
        thread.join(10)
        assert not gc.isenabled()  # the other thread's pause ended, this one has not
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with imports_without_gc():
        pass
    assert not gc.isenabled()


def test_a_child_forked_during_a_pause_has_the_collector_back() -> None:
    read, write = os.pipe()
    with imports_without_gc():
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running the parent's cleanup
            os.write(write, b"on" if gc.isenabled() else b"off")
            os._exit(0)
        assert not gc.isenabled()
    os.waitpid(pid, 0)
    assert os.read(read, 8) == b"on"
    os.close(read)
    os.close(write)


_FREEZE = """
import gc, sys
from trainflow.tasks.import_gc import freeze_at_exit, freeze_imported, imports_without_gc

class Cycle:
    def __del__(self):
        print("collected", flush=True)

with imports_without_gc():
    import decimal
    garbage = Cycle()
    garbage.me = garbage  # cyclic garbage left by the imports: no collection ran in the pause
    del garbage
    if sys.argv[1] != "exit":  # at the end of the pause, as the pause's users do
        freeze_imported(collect=sys.argv[1] == "collect")
        print("decimal frozen:", gc.get_freeze_count() > len(vars(decimal)))
if sys.argv[1] == "exit":
    freeze_at_exit()
gc.collect()
print("end")
"""


@pytest.mark.parametrize(
    ("how", "lines"),
    [
        ("collect", ["collected", "decimal frozen: True", "end"]),
        ("plain", ["decimal frozen: True", "end"]),  # the cycle stays, frozen: never collected
        ("exit", ["collected", "end"]),  # collected by gc.collect(); nothing frozen until exit
    ],
)
def test_what_was_imported_is_frozen_with_or_without_a_collection_first(
    how: str, lines: list[str]
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FREEZE, how], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == lines


def test_everything_is_frozen_at_exit_so_the_exit_collects_nothing() -> None:
    code = (
        "from trainflow.tasks.import_gc import freeze_at_exit\n"
        "class Cycle:\n"
        "    def __del__(self):\n"
        "        print('collected', flush=True)\n"
        "{freeze}\n"
        "garbage = Cycle(); garbage.me = garbage; del garbage\n"
    )
    for freeze, lines in (("pass", ["collected"]), ("freeze_at_exit()", [])):
        out = subprocess.run(
            [sys.executable, "-c", code.format(freeze=freeze)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.splitlines() == lines, freeze


_JOB = """
import sys
from pathlib import Path
import submitit
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor

def where():
    import gc, sys
    return sys.modules["__main__"].__spec__.name, gc.isenabled(), gc.get_freeze_count() > 0

executor = make_executor(ClusterConfig(executor="local", ranks_per_node=1), Path(sys.argv[1]))
print(executor.submit(where).result())
sys.path.insert(0, sys.argv[2])  # a module only this process finds: the rank cannot load the job
import only_here
try:
    executor.submit(only_here.answer).result()
except submitit.core.utils.FailedJobError as err:
    print("failed:", "No module named 'only_here'" in str(err))
"""


def test_a_rank_runs_under_rank_main_and_a_job_it_cannot_load_fails_as_before(
    tmp_path: Path,
) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "only_here.py").write_text("def answer():\n    return 42\n")
    out = subprocess.run(
        [sys.executable, "-c", _JOB, str(tmp_path / "jobs"), str(tmp_path / "code")],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines == ["('trainflow.cluster.rank_main', True, True)", "failed: True"], out.stdout
