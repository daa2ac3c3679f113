"""cluster.executor=allocation without Slurm: config validation, the refusal outside a Slurm job
(before any work), and the srun step it would start. tests/slurm/test_allocation_executor.py
runs it for real."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.restarts import can_exclude
from trainflow.cluster.slurm_checks import check_cluster
from trainflow.cluster.srun_executor import STEP_PREFIX, AllocationExecutor, cpus_per_node
from trainflow.errors import ConfigError
from trainflow.flows.config import PipelineConfig
from trainflow.flows.preflight import preflight

OUTSIDE = r"^cluster.executor=allocation .* runs in none \(no SLURM_JOB_ID\): run it in an "


def test_allocation_spans_several_nodes_where_local_is_refused() -> None:
    assert ClusterConfig(executor="allocation", nodes=2).nodes == 2
    with pytest.raises(ValidationError, match="or allocation inside a multi-node Slurm job"):
        ClusterConfig(executor="local", nodes=2)


def test_allocation_outside_a_slurm_job_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg = PipelineConfig.model_validate(
        {"workdir": str(tmp_path / "work"), "cluster": {"executor": "allocation"}}
    )
    with pytest.raises(ConfigError, match=OUTSIDE) as refused:
        preflight(cfg)
    assert "\n" not in str(refused.value)  # one line: what is wrong and the fix
    assert "cluster.executor=slurm or local" in str(refused.value)
    with pytest.raises(ConfigError, match=OUTSIDE):
        make_executor(cfg.cluster, tmp_path / "jobs")
    assert not (tmp_path / "work").exists()


def test_allocation_needs_the_nodes_cpus_and_gpus_it_asks_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "4(x1),2")
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    check_cluster(ClusterConfig(executor="allocation", nodes=2, ranks_per_node=2))
    with pytest.raises(ConfigError, match=r"cluster.nodes=3, but this Slurm job has 2 node"):
        check_cluster(ClusterConfig(executor="allocation", nodes=3))
    too_many = ClusterConfig(executor="allocation", ranks_per_node=2, cpus_per_task=2)
    with pytest.raises(ConfigError, match=r"= 4 CPUs per node, but this Slurm job has 2 on"):
        check_cluster(too_many)
    gpus = ClusterConfig(executor="allocation", ranks_per_node=2, gpus_per_node=2)
    with pytest.raises(ConfigError, match=r"has 0 GPU\(s\) per node: .* --gpus-per-node=2"):
        check_cluster(gpus)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    check_cluster(gpus)
    assert cpus_per_node("8(x2)") == 8 and cpus_per_node("") is None


def test_the_step_runs_every_rank_guarded_over_the_nodes_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    cfg = ClusterConfig(executor="allocation", nodes=2, ranks_per_node=2, cpus_per_task=3)
    executor = make_executor(cfg, tmp_path)
    assert isinstance(executor, AllocationExecutor)
    executor.update_parameters(exclude="tfnode9")
    command = executor.task_command()
    assert "-m trainflow.cluster.rank_guard --peer-timeout-s 60 " in command
    argv = executor.srun_argv(command, "41-abcd")
    assert argv[:2] == ["srun", f"--job-name={STEP_PREFIX}41-abcd"]
    for option in ("--overlap", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2"):
        assert option in argv
    assert "--cpus-per-task=3" in argv and "--exclude=tfnode9" in argv
    assert f"--output={tmp_path}/41-abcd_%t_log.out" in argv
    assert not [a for a in argv if a.startswith("--gpus")]
    gpu = make_executor(cfg.model_copy(update={"gpus_per_node": 2}), tmp_path)
    assert isinstance(gpu, AllocationExecutor)
    assert "--gpus-per-task=1" in gpu.srun_argv(command, "41-x")
    with pytest.raises(ValueError, match="does not take"):
        executor.update_parameters(partition="gpu")


def test_restarts_exclude_a_lost_node_only_when_the_allocation_has_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    assert can_exclude(ClusterConfig(executor="allocation", nodes=1), {"n1"})
    assert not can_exclude(ClusterConfig(executor="allocation", nodes=2), {"n1"})
