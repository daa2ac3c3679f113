"""The whole pipeline on the tiny preset with 2 DDP ranks, twice: the second run hits the cache."""

import re
import shutil
from pathlib import Path
from typing import Any
from uuid import UUID

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
)
from prefect.client.schemas.objects import Artifact as ArtifactResponse
from prefect.client.schemas.sorting import ArtifactSort

from tests.services import wait_for
from trainflow.flows.config import build_config, config_hash
from trainflow.flows.pipeline import PipelineSummary, pipeline
from trainflow.tasks.tracking.packages import package_lock_hash
from trainflow.tasks.tracking.runs import use_tracking_uri
from trainflow.tasks.train.native_bf16 import this_cpu
from trainflow.tasks.train.precision import resolve_precision

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="module")
def first(workdir: Path) -> PipelineSummary:
    return pipeline(preset="tiny", overrides=[f"workdir={workdir}"])


def _children(client: MlflowClient, summary: PipelineSummary) -> dict[str, object]:
    exp = client.get_experiment_by_name(summary.experiment)
    assert exp is not None
    runs = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{summary.parent_run_id}'"
    )
    return {r.info.run_name: r for r in runs}


def _artifacts(key: str, flow_run: UUID | None = None, limit: int = 1) -> list[ArtifactResponse]:
    """The newest artifacts `key` (of `flow_run`, when given)."""
    found = ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
    if flow_run is not None:
        found.flow_run_id = ArtifactFilterFlowRunId(any_=[flow_run])
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=found, sort=ArtifactSort.CREATED_DESC, limit=limit
        )


def _artifact(key: str, run: PipelineSummary) -> ArtifactResponse:
    """The artifact `key` of `run`'s flow run. The Prefect server is the whole test run's
    (tests/conftest.py): other tests' runs make artifacts of the same keys meanwhile, so the
    flow run is the one whose summary links `run`'s MLflow parent run."""
    flow_run = next(
        (
            a.flow_run_id
            for a in _artifacts("trainflow-summary", limit=100)
            if f"/runs/{run.parent_run_id}" in str(a.data)
        ),
        None,
    )
    assert flow_run is not None, f"no trainflow-summary links MLflow run {run.parent_run_id}"
    [artifact] = _artifacts(key, flow_run)
    return artifact


def test_pipeline_completes_and_learns(first: PipelineSummary) -> None:
    # 4 learnable classes: chance is 0.25.
    assert first.test_accuracy > 0.6
    assert not first.preprocess_cached
    assert set(first.stage_seconds) == {"preprocess", "train", "evaluate"}


def test_mlflow_holds_parent_and_three_children(first: PipelineSummary) -> None:
    client = MlflowClient(first.tracking_uri)
    parent = client.get_run(first.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["train.epochs"] == "2"
    assert parent.data.tags["dataset_hash"] == first.dataset_hash
    assert parent.data.tags["git_commit"]
    assert parent.data.tags["config_hash"] == config_hash(build_config("tiny"))
    assert parent.data.metrics["test_accuracy"] == pytest.approx(first.test_accuracy)
    kids = _children(client, first)
    assert set(kids) == {"preprocess", "train", "evaluate"}
    assert all(r.info.status == "FINISHED" for r in kids.values())  # type: ignore[attr-defined]


def test_train_run_has_per_epoch_metrics(first: PipelineSummary) -> None:
    client = MlflowClient(first.tracking_uri)
    train = _children(client, first)["train"]
    run_id = train.info.run_id  # type: ignore[attr-defined]
    for key in ("train_loss", "val_accuracy", "samples_per_s"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2], key
    # What precision=auto picked on the ranks' CPU, and why (the CPU named, its flags read).
    policy = resolve_precision("auto", torch.device("cpu"))
    params = client.get_run(run_id).data.params
    assert (params["precision"], params["precision.used"]) == ("auto", policy.name)
    assert params["precision.reason"] == policy.reason and this_cpu().model in policy.reason
    jobs = Path(first.tracking_uri.removeprefix("sqlite:///")).parent / "runs"
    (log,) = jobs.glob(f"{first.parent_run_id}/jobs/*_0_log.out")
    assert f"precision {policy.name}: {policy.reason}\n" in log.read_text()


def test_evaluate_run_has_metrics_images_and_model(first: PipelineSummary) -> None:
    client = MlflowClient(first.tracking_uri)
    ev = _children(client, first)["evaluate"]
    run_id = ev.info.run_id  # type: ignore[attr-defined]
    metrics = client.get_run(run_id).data.metrics
    assert metrics["test_accuracy"] == pytest.approx(first.test_accuracy)
    assert "test_f1_0" in metrics and "test_macro_f1" in metrics
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"confusion_matrix.png", "training_curves.png", "per_class.json"} <= names
    assert first.model_uri
    with use_tracking_uri(first.tracking_uri):  # models:/ URIs resolve via the global URI
        info = mlflow.models.get_model_info(first.model_uri)
    assert info.signature is not None
    assert info.run_id == run_id


def test_summary_artifact_links_the_mlflow_run(first: PipelineSummary) -> None:
    artifact = _artifact("trainflow-summary", first)
    assert artifact.type == "markdown"
    text = str(artifact.data)
    assert f"{first.test_accuracy:.4f}" in text
    assert first.dataset_hash[:16] in text
    assert f"/runs/{first.parent_run_id}" in text
    assert str(first.model_uri) in text
    assert f"`reference_cnn-classification` version **{first.model_version}**" in text
    assert "**yes**: `@champion` moved here; first champion" in text


def test_first_model_is_registered_as_the_champion(first: PipelineSummary) -> None:
    assert (first.registered_model, first.model_version, first.champion) == (
        "reference_cnn-classification",
        "1",
        True,
    )
    client = MlflowClient(first.tracking_uri)
    mv = client.get_model_version_by_alias("reference_cnn-classification", "champion")
    assert str(mv.version) == "1"
    parent_tags = client.get_run(first.parent_run_id).data.tags
    for key in ("dataset_hash", "git_commit", "config_hash"):
        assert mv.tags[key] == parent_tags[key], key
    assert float(mv.tags["test_accuracy"]) == first.test_accuracy
    ev = _children(client, first)["evaluate"]
    assert mv.run_id == ev.info.run_id  # type: ignore[attr-defined]
    assert ev.data.tags["registered_model_version"] == "1"  # type: ignore[attr-defined]
    assert ev.data.tags["champion"] == "true"  # type: ignore[attr-defined]


def test_train_run_shows_throughput_per_rank_mfu_and_system_metrics(
    first: PipelineSummary,
) -> None:
    client = MlflowClient(first.tracking_uri)
    train = client.get_run(_children(client, first)["train"].info.run_id)  # type: ignore[attr-defined]
    for key in ("rank_samples_per_s_min", "rank_step_time_s_max", "achieved_flops_per_s", "mfu"):
        assert [m.step for m in client.get_metric_history(train.info.run_id, key)] == [1, 2], key
    m = train.data.metrics
    assert m["rank_samples_per_s_min"] <= m["rank_samples_per_s_median"]
    assert m["rank_samples_per_s_median"] <= m["rank_samples_per_s_max"]
    assert 0 < m["mfu"] < 1
    assert train.data.tags["mfu_peak"].startswith("measured")  # a CPU here
    # One node (the local executor): one monitor, named by the host.
    nodes = {k.split("/")[1] for k in m if k.startswith("system/")}
    assert len(nodes) == 1
    assert f"system/{nodes.pop()}/cpu_utilization_percentage" in m


def test_prefect_shows_training_progress_and_the_summary_links_each_stage(
    first: PipelineSummary,
) -> None:
    progress = _artifact("train-progress", first)
    assert progress.type == "progress"
    assert float(str(progress.data)) == 100.0
    assert progress.description == "training: epoch 2 of 2 checkpointed"
    shards = _artifact("preprocess-progress", first)  # preprocessing, by shard-writing tasks
    assert float(str(shards.data)) == 100.0
    assert re.fullmatch(
        r"preprocessing: (\d+) of \1 shard-writing tasks done", shards.description or ""
    )
    text = str(_artifact("trainflow-summary", first).data)
    client = MlflowClient(first.tracking_uri)
    for stage, run in _children(client, first).items():
        assert f"- {stage}: [{run.info.run_id}](" in text  # type: ignore[attr-defined]
    evaluate = _children(client, first)["evaluate"].info.run_id  # type: ignore[attr-defined]
    assert f"get-artifact?path=training_curves.png&run_uuid={evaluate})" in text


def test_the_training_job_gives_the_test_accuracy_before_the_evaluate_stage_starts(
    first: PipelineSummary,
) -> None:
    """The run's first result comes from the training job: rank 0 says the best weights'
    test accuracy (the evaluate stage's own number) and logs it to the train run while the
    train task still runs; the evaluate task then says it again before its slower rest
    (figures, the model's export, registration)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    summary = _artifact("trainflow-summary", first)
    assert summary.flow_run_id is not None
    value = f"{first.headline_value:.4f}"
    job_said = f"[rank0] test accuracy {value} (first result: epoch "
    evaluate_said = f"test accuracy {value} (the training job's test pass: {value};"
    with get_client(sync_client=True) as client:
        ours = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[summary.flow_run_id]))

        def said(text: str) -> Any:
            return next((x for x in client.read_logs(ours) if x.message.startswith(text)), None)

        # The flow's log lines reach the API in batches, a moment after the flow returned.
        job_line = wait_for(lambda: said(job_said), 30, f"the log line {job_said!r}")
        evaluate_line = wait_for(lambda: said(evaluate_said), 30, repr(evaluate_said))
        assert job_line.task_run_id is not None and evaluate_line.task_run_id is not None
        train_task = client.read_task_run(job_line.task_run_id)
        evaluate_task = client.read_task_run(evaluate_line.task_run_id)
    assert train_task.name.startswith("train") and evaluate_task.name.startswith("evaluate")
    assert train_task.end_time is not None and evaluate_task.start_time is not None
    assert job_line.timestamp <= train_task.end_time <= evaluate_task.start_time
    # Said while the evaluate task still had its figures, export and registration to do.
    assert evaluate_task.end_time is not None
    assert (evaluate_task.end_time - evaluate_line.timestamp).total_seconds() > 0
    mlflow_client = MlflowClient(first.tracking_uri)
    train_run = _children(mlflow_client, first)["train"].info.run_id  # type: ignore[attr-defined]
    (point,) = mlflow_client.get_metric_history(train_run, "test_accuracy")
    assert point.value == pytest.approx(first.headline_value)
    assert f"epoch {point.step}'s best weights" in job_line.message


def test_second_run_hits_the_preprocess_cache(first: PipelineSummary, workdir: Path) -> None:
    second = pipeline(preset="tiny", overrides=[f"workdir={workdir}"])
    assert second.preprocess_cached
    assert second.dataset_hash == first.dataset_hash
    assert second.parent_run_id != first.parent_run_id
    client = MlflowClient(second.tracking_uri)
    pre = _children(client, second)["preprocess"]
    assert pre.data.tags["cache"] == "hit"  # type: ignore[attr-defined]
    # Same recipe, same data: a second version that takes the alias only on a strictly better
    # test accuracy (an equal one, the usual outcome, leaves version 1 the champion).
    assert second.model_version == "2"
    assert second.champion == (second.test_accuracy > first.test_accuracy)
    holder = client.get_model_version_by_alias("reference_cnn-classification", "champion")
    assert str(holder.version) == ("2" if second.champion else "1")
    text = str(_artifact("trainflow-summary", second).data)
    assert "version **2**" in text
    assert ("moved here; beats version 1" if second.champion else "stays on version 1") in text
    assert client.get_run(second.parent_run_id).data.tags["config_hash"] == config_hash(
        build_config("tiny")
    )


def test_deleted_dataset_is_rebuilt_not_served_from_cache(
    first: PipelineSummary, workdir: Path
) -> None:
    shutil.rmtree(workdir / "datasets")
    third = pipeline(preset="tiny", overrides=[f"workdir={workdir}"])
    assert not third.preprocess_cached
    assert third.dataset_hash == first.dataset_hash
    assert (workdir / "datasets").is_dir()


def test_every_stage_run_logs_the_dataset_and_the_model_carries_its_lineage(
    first: PipelineSummary,
) -> None:
    client = MlflowClient(first.tracking_uri)
    kids = _children(client, first)
    contexts = {"preprocess": "preprocessed", "train": "training", "evaluate": "evaluation"}
    for stage, context in contexts.items():
        inputs = kids[stage].inputs.dataset_inputs  # type: ignore[attr-defined]
        assert [i.dataset.digest for i in inputs] == [first.dataset_hash[:32]], stage
        assert {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == context
    # The ranks ran in this interpreter's environment (local executor): same package set.
    lock = package_lock_hash()
    mv = client.get_model_version("reference_cnn-classification", str(first.model_version))
    for tags in (kids["train"].data.tags, kids["evaluate"].data.tags, mv.tags):  # type: ignore[attr-defined]
        assert tags["package_lock_hash"] == lock
        assert tags["dataset_hash"] == first.dataset_hash
        assert tags["config_hash"] == config_hash(build_config("tiny"))
        assert tags["git_commit"]
