"""Job folders are private whatever the umask: a second real user (created here when missing)
in the same group can neither read nor replace a job's pickles, and the flow refuses results
from a folder that others can write.

Real local jobs, a real second user: the peer's attempts run in a process started as that user.
"""

import json
import operator
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import submitit

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import JobError

PEER = "trainflow-peer"

# Run as the peer: try to read, overwrite and replace each target; print what happened.
_ATTEMPTS = """
import json, os, sys
out = {}
for target in json.loads(sys.argv[1]):
    scratch = os.path.join(sys.argv[2], "peer-" + os.path.basename(target))
    def replace():
        with open(scratch, "wb") as f:
            f.write(b"not what you submitted")
        os.replace(scratch, target)
    tries = {
        "read": lambda: open(target, "rb").read(1),
        "overwrite": lambda: open(target, "r+b").write(b"x"),
        "replace": replace,
    }
    for name, attempt in tries.items():
        try:
            attempt()
            out[f"{os.path.basename(target)} {name}"] = "done"
        except PermissionError:
            out[f"{os.path.basename(target)} {name}"] = "denied"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def peer() -> pwd.struct_passwd:
    """A second local user (its own group), created when missing; needs root."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a second local user and acts as it")
    try:
        return pwd.getpwnam(PEER)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    args = ["--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin"]
    made = subprocess.run(["useradd", *args, PEER], capture_output=True, text=True)
    assert made.returncode in (0, 9), made.stderr  # 9: created meanwhile by another run
    return pwd.getpwnam(PEER)


@pytest.fixture
def project(peer: pwd.struct_passwd) -> Iterator[Path]:
    """A group project space: setgid 2775, group shared with the peer, as on clusters."""
    path = Path(tempfile.mkdtemp(prefix="trainflow-project-"))
    os.chown(path, 0, peer.pw_gid)
    path.chmod(0o2775)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def umask_002() -> Iterator[None]:
    previous = os.umask(0o002)
    yield
    os.umask(previous)


def _peer_python(peer: pwd.struct_passwd) -> str:
    """A Python the peer may run (ours may live under root's 0700 home)."""
    for candidate in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"):
        try:
            subprocess.run([candidate, "-I", "-S", "-c", "0"], user=peer.pw_uid, check=True)
        except (OSError, subprocess.CalledProcessError):
            continue
        return candidate
    pytest.skip(f"no Python that {PEER} may run")


def _as_peer(peer: pwd.struct_passwd, targets: list[Path], scratch: Path) -> dict[str, str]:
    paths = json.dumps([str(t) for t in targets])
    done = subprocess.run(
        [_peer_python(peer), "-I", "-S", "-c", _ATTEMPTS, paths, str(scratch)],
        user=peer.pw_uid,
        group=peer.pw_gid,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, str] = json.loads(done.stdout)
    return result


def _local(folder: Path) -> submitit.Executor:
    return make_executor(ClusterConfig(executor="local", ranks_per_node=1), folder)


@pytest.mark.services
def test_a_peer_in_the_group_can_neither_read_nor_replace_job_pickles_under_umask_002(
    peer: pwd.struct_passwd, project: Path, umask_002: None
) -> None:
    control = project / "control"  # what umask 002 gives anything else in the project space
    control.mkdir()
    (control / "plain.pkl").write_bytes(b"group-writable")
    assert _as_peer(peer, [control / "plain.pkl"], project) == {
        "plain.pkl read": "done",
        "plain.pkl overwrite": "done",
        "plain.pkl replace": "done",
    }, "the peer should reach group files here: the test set-up is wrong"

    folder = project / "runs" / "r1" / "jobs"
    job = _local(folder).submit(operator.mul, 6, 7)
    assert wait_for_job(job, print) == 42
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    pickles = sorted(folder.glob("*.pkl"))
    expected = [f"{job.job_id}_0_result.pkl", f"{job.job_id}_submitted.pkl"]
    assert [p.name for p in pickles] == expected
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert set(modes.values()) == {0o600}, modes  # logs too
    tried = _as_peer(peer, pickles, project)
    assert len(tried) == 6 and set(tried.values()) == {"denied"}, tried


def _finished_job(folder: Path) -> submitit.Job[int]:
    job = _local(folder).submit(operator.mul, 6, 7)
    deadline = time.monotonic() + 120  # a guard against a hang, not a timing assertion
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.done()
    return job


def test_the_flow_refuses_results_from_a_folder_or_pickle_others_can_write(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "jobs"
    job = _finished_job(folder)
    result = job.paths.result_pickle
    folder.chmod(0o770)
    group_writable = rf"refusing .*: {folder} is writable by its group \(mode 0770\)"
    with pytest.raises(JobError, match=group_writable):
        wait_for_job(job, print)
    folder.chmod(0o700)
    result.chmod(0o602)
    with pytest.raises(JobError, match=rf"{result} is writable by other users"):
        wait_for_job(job, print)
    result.chmod(0o600)
    assert wait_for_job(job, print) == 42


@pytest.mark.services
def test_pickles_or_folders_of_another_user_are_refused(
    peer: pwd.struct_passwd, tmp_path: Path
) -> None:
    folder = tmp_path / "jobs"
    job = _finished_job(folder)
    os.chown(job.paths.result_pickle, peer.pw_uid, peer.pw_gid)
    with pytest.raises(JobError, match=rf"_result.pkl belongs to uid {peer.pw_uid}, not to you"):
        wait_for_job(job, print)
    os.chown(folder, peer.pw_uid, peer.pw_gid)
    with pytest.raises(JobError, match=rf"job folder {folder} belongs to uid {peer.pw_uid}"):
        _local(folder)
