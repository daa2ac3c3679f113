"""Packaging: a CPU install carries no CUDA library; GPU nodes get dask-cuda and CuPy from the
`gpu` extra (requirements.lock), and the two locks agree on everything they share."""

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# nvidia-nvvm, nvidia-nvjitlink, cuda-bindings, cuda-toolkit, cupy-cuda13x, dask-cuda...
_CUDA = re.compile(r"^(nvidia-|cuda-|cupy|dask-cuda|rapids-|numba-cuda|pynvml)")


def _pins(lock: str) -> dict[str, str]:
    text = (ROOT / lock).read_text()
    found = re.findall(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", text, flags=re.M)
    return {name.lower().replace("_", "-"): version for name, version in found}


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[=<>~! ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_cpu_lock_has_no_cuda_package_and_the_gpu_lock_has_the_gpu_extra() -> None:
    cpu, gpu = _pins("requirements-cpu.lock"), _pins("requirements.lock")
    assert len(cpu) > 100  # the file was read and parsed
    assert sorted(n for n in cpu if _CUDA.match(n)) == []
    assert {"dask-cuda", "cupy-cuda13x", "nvidia-nvvm", "cuda-bindings"} <= set(gpu)
    differing = {n: (v, gpu.get(n)) for n, v in cpu.items() if gpu.get(n) != v}
    assert differing == {}, "the locks disagree: run `make lock`"


def test_cuda_packages_come_only_with_the_gpu_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _requirement_names(project["dependencies"])
    assert sorted(n for n in base if _CUDA.match(n)) == []
    assert {"dask-cuda", "cupy-cuda13x"} <= _requirement_names(
        project["optional-dependencies"]["gpu"]
    )


@pytest.mark.skipif(
    not (Path(sys.prefix) / ".installed-cpu").exists(),
    reason="not a CPU venv made by `make setup` (GPU=0)",
)
def test_the_cpu_venv_has_no_cuda_distribution() -> None:
    installed = {
        d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions()
    }
    assert "torch" in installed and "distributed" in installed
    assert sorted(n for n in installed if _CUDA.match(n)) == []
    # Without dask-cuda, preprocessing's `auto` backend takes a CPU LocalCluster:
    # tests/unit/test_dask_cluster.py::test_auto_falls_back_to_cpu_without_gpu.
