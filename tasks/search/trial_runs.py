"""A trial's MLflow child run under the search's parent run, from the array task's rank 0.

Trials are created by the array tasks as they ask the study, so the task opens each trial's
run itself (the flow cannot know them in advance). The run id is kept as the trial's user
attribute: a retry (RetryFailedTrialCallback copies user attributes) continues the same run.
"""

from typing import Any

from trainflow.tasks.train.config import TrainConfig

RUN_ATTR = "mlflow_run_id"
"""The trial's user attribute holding its MLflow run id."""


def open_trial_run(
    tracking_uri: str, parent_id: str, trial: Any, number: int, train: TrainConfig
) -> str:
    """The trial's run: created RUNNING with the trial's params and config, or, for a
    retry, its first try's run set RUNNING again and tagged retried."""
    from mlflow.tracking import MlflowClient

    from trainflow.tasks.tracking import runs

    client = MlflowClient(tracking_uri)
    run_id = trial.user_attrs.get(RUN_ATTR)
    if run_id:
        client.update_run(run_id, status="RUNNING")
        runs.set_tags(client, run_id, {"trial_state": "running (retried)", "retried": "true"})
        return str(run_id)
    parent = client.get_run(parent_id)
    run_id = runs.create_run(
        client,
        parent.info.experiment_id,
        f"trial[{number}]",
        parent_id=parent_id,
        tags={"stage": "train", "trial": str(number), "trial_state": "running"},
    )
    trial.set_user_attr(RUN_ATTR, run_id)  # first: a cancellation from here on closes it
    params = {f"train.{k}": str(v) for k, v in train.model_dump(mode="json").items()}
    runs.log_params(client, run_id, {**params, **_searched(trial.params)})
    return run_id


def _searched(params: dict[str, Any]) -> dict[str, str]:
    return {f"search.{k}": str(v) for k, v in params.items()}


def close_trial_run(tracking_uri: str, run_id: str, state: str, status: str) -> None:
    """End the run with MLflow `status` (FINISHED, FAILED, KILLED) and the trial's `state`
    (complete, pruned at epoch N, failed) as its trial_state tag."""
    from mlflow.tracking import MlflowClient

    from trainflow.tasks.tracking import runs

    client = MlflowClient(tracking_uri)
    runs.set_tags(client, run_id, {"trial_state": state})
    runs.finish_run(client, run_id, status)
