"""Optuna's own pictures of a study, as images on the search's parent run: the optimisation
history, every trial's intermediate values (where the pruned ones stopped) and the
parameters' importances."""

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

PLOTS = ("optimization_history", "intermediate_values", "param_importances")
"""optuna.visualization.matplotlib functions drawn, each as plots/search_<name>.png."""


def log_study_plots(
    client: Any, run_id: str, study: Any, folder: Path, warn: Callable[[str], None]
) -> list[str]:
    """Draw each of PLOTS for `study` into `folder`, log them to `run_id` under plots/; a
    plot Optuna cannot draw (importances need two complete trials with varied values) is one
    warning, and so is each warning Optuna gives while drawing one. The names logged."""
    import matplotlib

    matplotlib.use("Agg")  # headless: cluster nodes and CI have no display
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm
    from optuna.exceptions import ExperimentalWarning

    from trainflow.tasks.search.study import quiet_optuna

    quiet_optuna()
    folder.mkdir(parents=True, exist_ok=True)
    logged = []
    for name in PLOTS:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warnings.simplefilter("ignore", ExperimentalWarning)  # matplotlib's are, all
                axes = getattr(ovm, f"plot_{name}")(study)
        except Exception as exc:
            warn(f"no {name.replace('_', ' ')} plot: {type(exc).__name__}: {exc}"[:300])
            continue
        for said in {str(w.message) for w in caught}:
            warn(f"{name.replace('_', ' ')} plot: {said}"[:300])
        path = folder / f"search_{name}.png"
        axes.figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(axes.figure)
        client.log_artifact(run_id, str(path), "plots")
        logged.append(name)
    return logged
