"""trainflow.compat: each replacement of a library's internals fails here first when the library
changes under it (a new version, or the replaced code no longer doing what the entry says)."""

import inspect

import pytest
import submitit
from submitit.slurm.slurm import SlurmJobEnvironment

from trainflow.compat import DASK_JOBQUEUE_VERSIONS, SUBMITIT_VERSIONS


def test_submitit_is_a_version_the_requeue_shield_was_checked_against() -> None:
    assert submitit.__version__ in SUBMITIT_VERSIONS, (
        f"submitit {submitit.__version__}: re-check trainflow.compat.shield_submitit_requeue "
        "against its SlurmJobEnvironment._requeue, then add the version"
    )


def test_submitits_requeue_is_still_a_bare_scontrol_call_of_the_same_signature() -> None:
    original = SlurmJobEnvironment.__dict__["_requeue"]
    assert list(inspect.signature(original).parameters) == ["self", "countdown"]
    source = inspect.getsource(original)
    assert "scontrol" in source and "requeue" in source and "check_call" in source


def test_the_shield_replaces_submitits_requeue_with_the_given_call(monkeypatch) -> None:
    from trainflow.compat import shield_submitit_requeue

    monkeypatch.setattr(SlurmJobEnvironment, "_requeue", SlurmJobEnvironment._requeue)
    called: list[str] = []
    shield_submitit_requeue(called.append)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    env = SlurmJobEnvironment.__new__(SlurmJobEnvironment)
    env._requeue(3)
    assert called == ["42"]


def test_dask_jobqueue_is_a_version_whose_import_still_sets_a_sigint_handler() -> None:
    import importlib.metadata
    import importlib.util

    version = importlib.metadata.version("dask-jobqueue")
    assert version in DASK_JOBQUEUE_VERSIONS, (
        f"dask-jobqueue {version}: if its runner no longer sets SIGINT on import "
        "(dask/dask-jobqueue#697), drop trainflow.compat.import_slurm_cluster"
    )
    spec = importlib.util.find_spec("dask_jobqueue.runner")
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as source:
        top_level = [line for line in source if line.startswith("signal.signal(signal.SIGINT")]
    assert top_level, "dask_jobqueue.runner no longer sets SIGINT at import: drop the shield"


@pytest.mark.services
def test_the_shielded_import_leaves_sigint_as_it_was() -> None:
    import subprocess
    import sys

    code = (
        "import signal, sys; from trainflow.compat import import_slurm_cluster; "
        "before = signal.getsignal(signal.SIGINT); assert 'dask_jobqueue' not in sys.modules; "
        "assert import_slurm_cluster().__name__ == 'SLURMCluster'; "
        "assert signal.getsignal(signal.SIGINT) is before; print('kept')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "kept", out.stderr


def test_torch_and_transformers_are_versions_the_fake_forward_was_checked_against() -> None:
    import torch
    import transformers

    from trainflow.compat import TORCH_FAKE_VERSIONS, TRANSFORMERS_FAKE_VERSIONS

    assert torch.__version__.split("+")[0] in TORCH_FAKE_VERSIONS, (
        f"torch {torch.__version__}: re-check trainflow.compat.fake_forward (FakeTensorMode in "
        "torch._subclasses.fake_tensor), then add the version"
    )
    assert transformers.__version__ in TRANSFORMERS_FAKE_VERSIONS, (
        f"transformers {transformers.__version__}: if a meta-device forward works without fake "
        "tensors (the test below), drop trainflow.compat.fake_forward; else add the version"
    )


def test_a_transformers_forward_fails_on_meta_and_runs_under_fake_tensors() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainflow.compat import fake_forward

    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=8, n_head=2, vocab_size=16)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).eval()
        ids = torch.empty((2, 4), dtype=torch.long)
        with pytest.raises(RuntimeError, match="meta tensors"):  # the reason for the entry
            model(ids)
        logits = fake_forward(model, ids).logits
    assert tuple(logits.shape) == (2, 4, 16)


def test_mlflow_pytorch_still_imports_lightnings_callback_at_its_end() -> None:
    import importlib.metadata
    import importlib.util

    from trainflow.compat import MLFLOW_PYTORCH_VERSIONS

    version = importlib.metadata.version("mlflow")
    assert version in MLFLOW_PYTORCH_VERSIONS, (
        f"mlflow {version}: re-check trainflow.compat.import_mlflow_pytorch against the end of "
        "mlflow/pytorch/__init__.py, then add the version"
    )
    spec = importlib.util.find_spec("mlflow.pytorch")
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as source:
        lines = source.read().splitlines()
    start = len(lines) - 1 - lines[::-1].index("try:")  # the last module-level try
    assert lines[start + 1].strip().startswith("from mlflow.pytorch._lightning_autolog import")
    assert "except ImportError:" in lines[start + 2 : start + 5], "drop import_mlflow_pytorch"
