"""The search stage: an Optuna study over train.* keys, its trials trained and pruned.

Takes a `SearchConfig` (the space, the trial budget, how many run at once, the sampler, the
pruner, the study's storage) and the training every trial starts from; trials are pulled by
the tasks of one job array, each trained as any TrainingJob and stopped early when the
pruner says so. Hands on the study, whose best complete trial holds its `CheckpointRef`.

Modules:
    config        SearchConfig: space, trials, parallel, sampler, pruner, storage, study.
    space         the space's syntax (loguniform, int, choice...) and its Optuna distributions.
    study         StudyRef; storage with heartbeats and retries, sampler, pruner, the budget.
    trial_worker  the array task: asks for a trial, trains it, reports each epoch, tells.
    trial_runs    a trial's MLflow child run, opened and closed by the array task.
    plots         Optuna's history, intermediate-value and importance plots on the parent run.
    array         the arrays of tasks: another while trials are left and no task is.
    watch         a line per trial that ended; the progress artifact.
    task          the Prefect @task: run the arrays, watched; cancel.
"""
