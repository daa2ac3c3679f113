"""P11's replay: the unpruned side's measured curves through a pruner in many trial orders.

One pruned search is one order of the grid, and which trials a pruner stops depends on the
trials it saw before. Training is deterministic here (a trial's per-epoch validation accuracy
is the same whether or not it is pruned later: P11 checks this on every pruned trial), so
the unpruned side's curves say what the pruned search would have reported in any order. Each
order is replayed through the pruners trainflow builds (`tasks.search.study.make_pruner`),
and through successive halving with other settings, in an in-memory Optuna study, one trial
at a time as `--parallel 1` runs them: a trial reports its epochs until the pruner stops it,
and a complete trial's value is its best epoch's, as the search records it.
"""

import random
import statistics
from collections.abc import Callable
from typing import Any

ORDERS = 200
"""Random orders replayed per pruner (after the measured order)."""


def product_pruner(name: str) -> Callable[[], Any]:
    """The pruner trainflow builds for `--pruner name`."""

    def make() -> Any:
        from trainflow.tasks.search.study import StudyRef, make_pruner

        ref = StudyRef(storage="sqlite://", name="replay", direction="maximize",
                       metric="val_accuracy", space=[], trials=1, sampler="grid",
                       pruner=name)  # fmt: skip
        return make_pruner(ref)

    return make


def halving(min_resource: int | str, reduction_factor: int) -> Callable[[], Any]:
    """Optuna's SuccessiveHalvingPruner with other settings than trainflow's, for comparison."""

    def make() -> Any:
        import optuna

        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=min_resource, reduction_factor=reduction_factor
        )

    return make


REPLAYED: dict[str, Callable[[], Any]] = {
    "--pruner asha": product_pruner("asha"),
    "--pruner median": product_pruner("median"),
    "halving, min_resource 1, reduction factor 3": halving(1, 3),
    "halving, min_resource auto, reduction factor 4": halving("auto", 4),
    "halving, min_resource auto, reduction factor 3": halving("auto", 3),
}
"""What the measured curves are replayed through: trainflow's two pruners, and successive
halving with the other settings its default was chosen against."""


def replay_order(curves: list[list[float]], make: Callable[[], Any]) -> tuple[int, float]:
    """Epochs trained and the best complete trial's value when `curves` (per-epoch values of
    trials, maximised) are searched in this order under the pruner `make` builds."""
    import optuna

    from trainflow.tasks.search.study import quiet_optuna

    quiet_optuna()
    study = optuna.create_study(direction="maximize", pruner=make())
    epochs, best = 0, float("-inf")
    for curve in curves:
        trial = study.ask()
        for epoch, value in enumerate(curve, 1):
            trial.report(value, epoch)
            epochs += 1
            if trial.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                break
        else:
            study.tell(trial, max(curve))
            best = max(best, max(curve))
    return epochs, best


def replay(
    curves: list[list[float]], make: Callable[[], Any], goal_points: float, goal_share: float
) -> dict[str, Any]:
    """`curves` in their measured order, then in ORDERS random orders (seeded): the measured
    order's epochs and best, and over all orders the share that meets the goal, that keeps
    the best within goal_points, the median and largest epoch share, and the median and
    worst difference to the best (points)."""
    full, top = sum(map(len, curves)), max(max(c) for c in curves)
    rng = random.Random(0)
    shares, points = [], []
    measured: dict[str, Any] = {}
    for i in range(ORDERS + 1):
        order = curves if i == 0 else rng.sample(curves, len(curves))
        epochs, best = replay_order(order, make)
        shares.append(epochs / full)
        points.append(100 * (best - top))
        if i == 0:
            measured = {"epochs": epochs, "best": best}
    kept = [p >= -goal_points for p in points]
    met = [k and s <= goal_share for k, s in zip(kept, shares, strict=True)]
    return {
        "measured_order": measured,
        "orders": ORDERS + 1,
        "goal_met_share": round(sum(met) / len(met), 3),
        "best_kept_share": round(sum(kept) / len(kept), 3),
        "epoch_share_median": round(statistics.median(shares), 3),
        "epoch_share_max": round(max(shares), 3),
        "difference_points_median": round(statistics.median(points), 2),
        "difference_points_worst": round(min(points), 2),
    }
