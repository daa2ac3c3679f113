"""`trainflow warm` (flows/warm_command.py): a real service process serving real `trainflow run`
commands as forks of itself; nothing mocked. A served run trains as a cold one does, its
command's signals and death reach it, and a command the service cannot run as a fresh process
would runs cold, saying why."""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.cgroups import own_memory_group, remove_group
from tests.services import background, service_env, wait_for
from trainflow.flows.warm_command import SOCKET_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _trainflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainflow.flows.cli", *args]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[Path]:
    """A running `trainflow warm`; its log file (the socket is beside it)."""
    folder = tmp_path_factory.mktemp("warm")
    sock, log = folder / "sockets" / "warm.sock", folder / "warm.log"
    env = service_env(PREFECT_API_URL=prefect_api)
    with background(_trainflow("warm", "--socket", str(sock)), log, env):
        wait_for(lambda: "serving on" in log.read_text(), 120, "trainflow warm to serve")
        yield log


def _env(service: Path, **extra: str) -> dict[str, str]:
    """The environment the service was started with, plus its socket: what the stack exports."""
    sock = service.parent / "sockets" / "warm.sock"
    return service_env(PREFECT_API_URL=os.environ["PREFECT_API_URL"], **{SOCKET_ENV: str(sock)},
                       **extra)  # fmt: skip


def _served(log: Path) -> dict[int, str]:
    """pid -> command line of every command the service ran, from its log."""
    return {int(pid): argv for pid, argv in re.findall(r"pid (\d+) runs (.*)", log.read_text())}


def _ended(log: Path, pid: int) -> int | None:
    found = re.search(rf"pid {pid} ended with (-?\d+)", log.read_text())
    return int(found.group(1)) if found else None


def _losses(store: str) -> list[float]:
    client = MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    [train] = [r for r in runs if r.info.run_name == "train"]
    return [m.value for m in client.get_metric_history(train.info.run_id, "train_loss")]


def test_a_served_run_trains_as_a_cold_run_does(tmp_path: Path, service: Path) -> None:
    outputs, losses = {}, {}
    for mode in ("served", "cold"):
        env = _env(service)
        if mode == "cold":
            env.pop(SOCKET_ENV)
        work = tmp_path / mode
        argv = _trainflow("run", "--preset", "tiny", "--set", f"workdir={work}")
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "warm command service" not in out.stderr
        outputs[mode] = out.stdout
        losses[mode] = _losses(f"sqlite:///{work}/mlflow.db")
    ours = [pid for pid, argv in _served(service).items() if str(tmp_path / "served") in argv]
    assert len(ours) == 1 and _ended(service, ours[0]) == 0  # the served one ran in a fork
    assert not [a for a in _served(service).values() if str(tmp_path / "cold") in a]
    # Same seed, same results: the fork trains bit for bit as a fresh process.
    assert len(losses["served"]) == 2 and losses["served"] == losses["cold"]
    for text in outputs.values():
        assert "== trainflow summary ==" in text and "test accuracy" in text
    line = [x for x in outputs["served"].splitlines() if x.startswith("test accuracy")]
    assert line == [x for x in outputs["cold"].splitlines() if x.startswith("test accuracy")]


def test_a_second_service_on_the_same_socket_is_refused(service: Path) -> None:
    sock = service.parent / "sockets" / "warm.sock"
    out = subprocess.run(_trainflow("warm", "--socket", str(sock)), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2
    assert out.stdout == f"trainflow warm: a service already serves on {sock} (stop it first)\n"


def test_a_refused_model_is_one_line_through_the_service(tmp_path: Path, service: Path) -> None:
    """...from the console script too: its sys.path[0], the virtualenv's bin/, holds scripts
    named as the libraries the service imported (dask, alembic): not modules, no refusal."""
    (tmp_path / "tf_user_models.py").write_text(
        "from torch import nn\n\n\ndef wrong_width(spec):\n"
        "    return nn.Sequential(nn.Flatten(), nn.LazyLinear(spec.num_classes + 1))\n"
    )
    script = str(Path(sys.executable).with_name("trainflow"))  # the service: python -m
    argv = [script, "run", "--preset", "tiny", "--set", f"workdir={tmp_path / 'work'}",
            "--set", "train.model=tf_user_models:wrong_width"]  # fmt: skip
    out = subprocess.run(
        argv, env=_env(service), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "gives (2, 5) for a batch of 2" in out.stderr
    [pid] = [p for p, a in _served(service).items() if str(tmp_path) in a]
    assert wait_for(lambda: _ended(service, pid), 30, "the service to log the end") == 2


@pytest.mark.parametrize("differs", ["environment", "path"])
def test_what_a_fork_would_import_otherwise_runs_cold_saying_why(
    tmp_path: Path, service: Path, differs: str
) -> None:
    """Another import-time setting (OMP_NUM_THREADS: read by torch when imported), or a folder
    on the command's path holding another copy of a library the service imported (torch)."""
    before = _served(service)
    argv = _trainflow("run", "--set", "train.epochs=0", "--set", f"workdir={tmp_path}")
    if differs == "environment":
        env = _env(service, OMP_NUM_THREADS="3")
        why = "the warm command service was started with other OMP_NUM_THREADS"
    else:
        (tmp_path / "shadow" / "torch").mkdir(parents=True)
        (tmp_path / "shadow" / "torch" / "__init__.py").write_text("")
        env = _env(service, PYTHONPATH=str(tmp_path / "shadow"))
        why = f"{tmp_path / 'shadow'} on the command's path holds torch"
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    first, error = out.stderr.splitlines()[:2]
    assert first == f"trainflow: {why}: running without the warm command service"
    assert error.startswith("trainflow: error: ") and "train.epochs" in out.stderr
    assert _served(service) == before
    assert f"ran cold: {' '.join(argv[3:])}: {why}" in service.read_text()  # the stack's log


OPEN_FILES = 1000
"""`ulimit -n` of the long runs' commands."""


def _start_long_run(
    service: Path, work: Path, group: Path | None = None
) -> tuple[subprocess.Popen[str], int]:
    """A served run training for long (its command in cgroup `group`, under `ulimit -n
    OPEN_FILES`); (its command, the served child's pid) at epoch 2."""
    argv = _trainflow("run", "--preset", "tiny", "--set", "train.epochs=5000",
                      "--set", f"workdir={work}")  # fmt: skip
    # The command's own limit on open files (below the service's): the fork must take it.
    setup = f"ulimit -n {OPEN_FILES}"
    if group is not None:
        setup = f"echo $$ > {group}/cgroup.procs && {setup}"
    argv = ["sh", "-c", f'{setup} && exec "$@"', "sh", *argv]
    proc = subprocess.Popen(argv, env=_env(service), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    while "epoch 2/5000" not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, "the run ended before epoch 2"
        assert time.monotonic() < deadline, "no epoch 2 within 240 s"
    [pid] = [p for p, a in _served(service).items() if str(work) in a]
    return proc, pid


def _ranks_gone(work: Path) -> bool:
    records = [json.loads(p.read_text()) for p in work.glob("runs/*/jobs/*_rank.json")]
    pids = [int(r[key]) for r in records for key in ("pid", "guard_pid")]
    return len(pids) == 4 and not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _statuses(work: Path) -> dict[str, str]:
    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {r.info.run_name: r.info.status for r in runs}


@pytest.fixture
def memory_group() -> Iterator[Path | None]:
    """A memory cgroup of the test's own (v1, root), removed after; None where none can be."""
    parent = own_memory_group()
    if parent is None:
        yield None
        return
    group = parent / f"trainflow-warm-test-{os.getpid()}"
    group.mkdir()
    try:
        yield group
    finally:
        remove_group(group)


def test_sigterm_to_a_served_command_cancels_its_job(
    tmp_path: Path, service: Path, memory_group: Path | None
) -> None:
    """...and the served run runs in the command's cgroup (a memory limit, a Slurm job's) and
    within its resource limits (`ulimit -n`), as do its ranks."""
    proc, pid = _start_long_run(service, tmp_path, memory_group)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) != (OPEN_FILES, OPEN_FILES)  # the service's
    ranks = [json.loads(p.read_text()) for p in tmp_path.glob("runs/*/jobs/*_rank.json")]
    assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (OPEN_FILES, OPEN_FILES)
    for served in [pid, *(int(r["pid"]) for r in ranks)]:
        assert resource.prlimit(served, resource.RLIMIT_NOFILE) == (OPEN_FILES, OPEN_FILES)
    if memory_group is not None:
        inside = {int(p) for p in (memory_group / "cgroup.procs").read_text().split()}
        assert pid in inside and proc.pid in inside
        ranks = [json.loads(p.read_text()) for p in tmp_path.glob("runs/*/jobs/*_rank.json")]
        assert len(ranks) == 2 and {int(r["pid"]) for r in ranks} <= inside
    try:
        proc.send_signal(signal.SIGTERM)  # passed on to the fork, which cancels as cold does
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert _ended(service, pid) == 130
    assert wait_for(lambda: _ranks_gone(tmp_path), 30, "the ranks to end")
    assert _statuses(tmp_path) == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}


def test_a_killed_command_stops_its_served_run(tmp_path: Path, service: Path) -> None:
    proc, pid = _start_long_run(service, tmp_path)
    proc.kill()  # SIGKILL: nothing of the command runs; the service sees its end
    proc.wait()
    assert wait_for(lambda: _ended(service, pid) is not None, 60, "the served run to end")
    assert _ended(service, pid) == 130  # SIGTERMed: it cancelled its job as Ctrl-C would
    assert wait_for(lambda: _ranks_gone(tmp_path), 30, "the ranks to end")
    assert _statuses(tmp_path)["train"] == "KILLED"
