"""What the flow says of a search's trials (tasks.search.watch) and its plots' warnings
(tasks.search.plots), from real Optuna trials and a real MLflow store."""

import warnings
from pathlib import Path

import optuna
from mlflow.tracking import MlflowClient
from optuna.distributions import BaseDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from trainflow.tasks.search.plots import log_study_plots
from trainflow.tasks.search.study import HANDED_ATTR
from trainflow.tasks.search.watch import progress_of, trial_line, trial_lines

LR: dict[str, BaseDistribution] = {"train.lr": FloatDistribution(1e-4, 1e-1, log=True)}


def _trial(state: TrialState, **kwargs: object) -> optuna.trial.FrozenTrial:
    return create_trial(state=state, params={"train.lr": 0.0123456}, distributions=LR, **kwargs)  # type: ignore[arg-type]


def test_each_outcome_has_its_words() -> None:
    study = optuna.create_study(direction="maximize")
    study.add_trial(_trial(TrialState.COMPLETE, value=0.91))
    study.add_trial(_trial(TrialState.PRUNED, intermediate_values={1: 0.4, 2: 0.5}))
    study.add_trial(_trial(TrialState.FAIL))
    complete, pruned, failed = study.get_trials()
    assert trial_line(complete, "val_accuracy") == (
        f"trial   0: {'complete  val_accuracy 0.9100':<36} train.lr=0.01235"
    )
    assert trial_line(pruned, "val_accuracy").startswith(
        "trial   1: pruned at epoch 2  val_accuracy 0.5000"
    )
    assert trial_line(failed, "val_accuracy").startswith("trial   2: failed ")


def test_a_trial_handed_over_at_its_task_s_requeue_is_said_to_go_on_not_to_fail() -> None:
    study = optuna.create_study(direction="maximize")
    study.add_trial(_trial(TrialState.FAIL, intermediate_values={1: 0.4}))
    study.add_trial(_trial(TrialState.COMPLETE, value=0.8, system_attrs={HANDED_ATTR: 0}))
    study.add_trial(_trial(TrialState.FAIL))  # a real failure
    lines = trial_lines(study, "val_accuracy")
    assert lines[0].startswith("trial   0: requeued, continued as trial 1 ")
    assert lines[1].startswith("trial   1: complete  val_accuracy 0.8000")
    assert lines[2].startswith("trial   2: failed ")
    assert progress_of(study, "val_accuracy")[0] == {"complete": 1, "failed": 1}


def test_optuna_s_warnings_while_drawing_become_the_search_s_warning_lines(
    tmp_path: Path,
) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())
    run_id = client.create_run(exp).info.run_id
    study = optuna.create_study(direction="maximize")
    for lr in (0.01, 0.02, 0.03):  # equal values: Optuna warns the importances are equal
        params, values = {"train.lr": lr}, {1: 0.5}
        trial = create_trial(
            state=TrialState.COMPLETE,
            value=0.5,
            params=params,
            distributions=LR,
            intermediate_values=values,
        )
        study.add_trial(trial)
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none may escape to the console
        logged = log_study_plots(client, run_id, study, tmp_path / "plots", said.append)
    assert logged == ["optimization_history", "intermediate_values", "param_importances"]
    assert said and all(line.startswith("param importances plot: ") for line in said), said
    names = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert names == {f"plots/search_{name}.png" for name in logged}
