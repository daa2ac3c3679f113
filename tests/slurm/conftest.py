"""A real Slurm cluster for every test under tests/slurm: reused if up, started if possible.

A cluster this session starts is left running: the next session reuses it in a second instead of
starting it again (`trainflow cluster down` stops it).
"""

import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainflow.cluster.dev.slurm import can_start, is_up, run, slurm_conf

HERE = Path(__file__).parent
NODES = 2
"""Nodes the dev cluster emulates for these tests (as in CI and `make test`)."""


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker here too, so these tests run under --strict-markers on their own."""
    config.addinivalue_line("markers", "slurm: needs a real Slurm cluster (tests/slurm)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/slurm with `slurm`."""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.slurm)


def _ensure_cluster() -> None:
    """Use a running cluster of NODES nodes, start one, or skip (fail in CI) with the reason."""
    if is_up(NODES):
        return
    ok, why = can_start()
    if ok:
        output = io.StringIO()
        if run("up", out=output, nodes=NODES) != 0:
            pytest.fail(f"`cluster/dev/slurm.sh up` failed:\n{output.getvalue()}", pytrace=False)
        return
    if os.environ.get("CI"):
        pytest.fail(f"no Slurm cluster in CI: {why}", pytrace=False)
    pytest.skip(f"no Slurm cluster: run `trainflow cluster up` (needs root and apt): {why}")


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster() -> Iterator[Path]:
    """The slurm.conf of a usable cluster, exported as SLURM_CONF for the session."""
    _ensure_cluster()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(slurm_conf())
    yield slurm_conf()
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


@pytest.fixture
def submitit_folder(tmp_path: Path) -> Path:
    """A fresh submitit folder per test: job ids restart at 1 after a state wipe, so a reused
    folder could hand back an old job's result."""
    folder = tmp_path / "submitit"
    folder.mkdir()
    return folder
