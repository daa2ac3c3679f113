"""The evaluate stage: the best checkpoint in, test metrics and a logged model out.

Takes the `CheckpointRef` and the `DatasetRef` the earlier stages handed on, an `EvaluateConfig`
and the stage's MLflow run; hands on an `EvalResult`: the headline and all test metrics, the
logged model's URI and, when registered, the version and the champion decision. Plots and
reports go to the run as artifacts.

Modules:
    config         EvaluateConfig: batch size, model logging and registration.
    task           the Prefect @task.
    run            the stage: checkpoint -> test metrics, plots, logged and registered model.
    predict        the test split streamed through the model, batch by batch.
    model_logging  the model exported (pt2) and logged with signature and requirements.
    hf_export      a transformers model logged as a save_pretrained folder.
    naming         the registered model's default name, <model>-<objective>.
    registry       a new registered version; the champion alias moves only on a strict win.
"""
