"""trainflow.compat: each replacement of a library's internals fails here first when the library
changes under it (a new version, or the replaced code no longer doing what the entry says)."""

import inspect

import submitit
from submitit.slurm.slurm import SlurmJobEnvironment

from trainflow.compat import SUBMITIT_VERSIONS


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
