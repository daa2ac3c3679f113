"""Register an evaluated model and move the champion alias only when it strictly wins.

Every evaluated model becomes a new version of a registered model, tagged with what made it
(dataset hash, git commit, config hash) and its decisive test metric. The alias (``champion``)
moves to the new version only when that metric strictly beats the current champion's, in the
objective's direction (greater accuracy or R², smaller loss, RMSE or perplexity); a tie keeps
the champion, so re-running the same config does not churn the alias.

Two pipelines finishing at the same moment: the MLflow registry has no compare-and-set for
aliases, so both may read the same champion and both decide to move the alias. The champion
is therefore read again right before the move and the decision is made anew against it. That
narrows the window to the time between two requests (milliseconds) but cannot close it: the
loser of that race may leave the alias on a version that beats the old champion but not the
other new one. Both versions and their metric tags stay in the registry, so the outcome can
be checked and corrected by hand; no lock service is worth running for this.
"""

import json
import math
from collections.abc import Mapping
from typing import NamedTuple

from mlflow.entities import RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS
from pydantic import BaseModel, ConfigDict

from trainflow.tasks.tracking.runs import use_tracking_uri

_MISSING = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")
_EXISTS = ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS")


class Champion(NamedTuple):
    """The version an alias points at and its metric (None: unknown)."""

    version: str
    metric: float | None


class RegistryResult(BaseModel):
    """What registration decided: the new version, and whether it took the alias."""

    model_config = ConfigDict(frozen=True)

    name: str
    """Registered model name."""
    version: str
    """The version created for this model."""
    alias: str
    """The alias that marks the champion."""
    champion: bool
    """Whether this version holds the alias now."""
    previous_version: str | None
    """The version that held the alias before (None: there was no champion)."""
    previous_metric: float | None
    """That version's metric (None: no champion, or its metric is unknown)."""
    reason: str
    """The decision in words, e.g. 'beats version 3 (0.9100 > 0.9000)'."""


def register_and_promote(
    client: MlflowClient,
    model_uri: str,
    name: str,
    run_id: str,
    metric_name: str,
    metric_value: float,
    tags: Mapping[str, str],
    alias: str = "champion",
    higher_is_better: bool = True,
) -> RegistryResult:
    """Register ``model_uri`` as a new version of ``name`` and move ``alias`` if it wins.

    ``tags`` (dataset_hash, git_commit, config_hash) go on the version with the metric value;
    the decision is tagged on the evaluate run ``run_id``.
    """
    ensure_registered_model(client, name)
    version = create_version(
        client, name, model_uri, run_id, {**tags, metric_name: repr(metric_value)}
    )
    seen = read_champion(client, name, alias, metric_name)
    won, holder, reason = promote(
        client, name, alias, version, metric_name, metric_value, seen, higher_is_better
    )
    result = RegistryResult(
        name=name,
        version=version,
        alias=alias,
        champion=won,
        previous_version=holder.version if holder else None,
        previous_metric=holder.metric if holder else None,
        reason=reason,
    )
    tag_decision(client, run_id, result)
    return result


def ensure_registered_model(client: MlflowClient, name: str) -> None:
    """Create the registered model unless it exists (another pipeline may create it too).

    Creating first, instead of looking it up first: a basic-auth server with
    ``default_permission = NO_PERMISSIONS`` answers 403, not 404, for a model that does not
    exist yet, while "already exists" is the same answer everywhere.
    """
    try:
        client.create_registered_model(name, description="Models evaluated by trainflow.")
    except MlflowException as err:
        if err.error_code not in _EXISTS:  # created earlier or meanwhile by another pipeline
            raise


def create_version(
    client: MlflowClient, name: str, model_uri: str, run_id: str, tags: Mapping[str, str]
) -> str:
    """A new version of ``name`` from a logged model URI; returns the version number."""
    model_id = _model_id(model_uri)
    # A `models:/m-...` source is resolved through MLflow's global tracking URI, not the
    # client's: point it at the client's store for the call.
    with use_tracking_uri(client.tracking_uri):
        mv = client.create_model_version(
            name, model_uri, run_id=run_id, tags=dict(tags), model_id=model_id
        )
    version = str(mv.version)
    if model_id:
        _link_logged_model(client, model_id, name, version)
    return version


def read_champion(client: MlflowClient, name: str, alias: str, metric_name: str) -> Champion | None:
    """The alias holder and its metric: the version tag, else its run's metric, else None."""
    holder = client.get_registered_model(name).aliases.get(alias)
    if holder is None:
        return None
    mv = client.get_model_version(name, str(holder))
    if metric_name in mv.tags:
        return Champion(str(holder), float(mv.tags[metric_name]))
    # Versions registered before the metric was tagged: read it from their evaluate run.
    return Champion(str(holder), _run_metric(client, mv.run_id, metric_name))


def decide(
    value: float, champion: Champion | None, higher_is_better: bool = True
) -> tuple[bool, str]:
    """Whether ``value`` takes the alias from ``champion``, and why (ties keep the champion)."""
    if champion is None:
        return True, "first champion of this registered model"
    old = champion.metric
    if old is None or math.isnan(old):
        return False, (
            f"champion version {champion.version} has no comparable metric, so it stays; "
            "tag that version with the metric (or move the alias by hand) to resume comparisons"
        )
    better, worse = (">", "<=") if higher_is_better else ("<", ">=")
    if value > old if higher_is_better else value < old:
        return True, f"beats version {champion.version} ({value:.4f} {better} {old:.4f})"
    return False, f"does not beat version {champion.version} ({value:.4f} {worse} {old:.4f})"


def promote(
    client: MlflowClient,
    name: str,
    alias: str,
    version: str,
    metric_name: str,
    value: float,
    seen: Champion | None,
    higher_is_better: bool = True,
) -> tuple[bool, Champion | None, str]:
    """Move ``alias`` to ``version`` if it beats the champion; returns (moved, champion, why).

    ``seen`` is the champion read earlier; it is read again right before the move, as another
    pipeline may have moved the alias in between (see the module docstring for the race).
    """
    won, reason = decide(value, seen, higher_is_better)
    if not won:
        return False, seen, reason
    now = read_champion(client, name, alias, metric_name)
    if now != seen:
        seen = now
        won, reason = decide(value, seen, higher_is_better)
        if not won:
            return False, seen, reason
    client.set_registered_model_alias(name, alias, version)
    return True, seen, reason


def tag_decision(client: MlflowClient, run_id: str, result: RegistryResult) -> None:
    """Record the registration and the champion decision as tags of the evaluate run."""
    tags = {
        "registered_model_name": result.name,
        "registered_model_version": result.version,
        "champion": str(result.champion).lower(),
        "champion_reason": result.reason,
    }
    if result.previous_version is not None:
        tags["previous_champion_version"] = result.previous_version
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def _model_id(model_uri: str) -> str | None:
    """The logged-model id of a ``models:/m-...`` URI (None for other URIs)."""
    rest = model_uri.removeprefix("models:/")
    return rest if rest != model_uri and rest.startswith("m-") and "/" not in rest else None


def _run_metric(client: MlflowClient, run_id: str | None, metric_name: str) -> float | None:
    if not run_id:
        return None
    try:
        return client.get_run(run_id).data.metrics.get(metric_name)
    except MlflowException as err:
        if err.error_code in _MISSING:  # the run was deleted
            return None
        raise


def _link_logged_model(client: MlflowClient, model_id: str, name: str, version: str) -> None:
    # The MLflow UI lists a logged model's registered versions from this tag (as
    # mlflow.register_model sets it); without it the model page shows none.
    model = client.get_logged_model(model_id)
    links = json.loads(model.tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    links.append({"name": name, "version": version})
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(links)})
