"""`train.init_from`: a new run that starts from another run's weights (and nothing else of
it: its optimizer, schedule, step and data order start afresh).

The source is resolved where the run is planned (the flow, with its workdir and MLflow store)
to one weights file, checked against the model built on the meta device before anything is
queued, and the ranks load that file right after building the model (under FSDP rank 0, whose
weights the other ranks' shards are filled from). Sources:

- a weights file: a checkpoint (`checkpoints/epoch-*.pt`) or a best model (`best.pt`);
- a run folder (`<workdir>/runs/<parent run id>`): its `best.pt`;
- a pipeline run's parent run id, under this config's workdir;
- `models:/<name>/<version>`: the registered version's pipeline run (its evaluate run's parent)
  under this config's workdir.
"""

from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainflow.errors import ConfigError

BEST = "best.pt"
"""A run folder's best weights (whole, also after FSDP)."""


def resolve(source: str, workdir: Path, tracking_uri: str | None = None) -> Path:
    """The weights file `source` names (see the module docstring); ConfigError in one line."""
    if source.startswith("models:/"):
        return _registered(source, workdir, tracking_uri)
    path = Path(source).expanduser()
    if path.is_file():
        return path.resolve()
    if path.is_dir():
        return _best_of(path, source)
    under = workdir / "runs" / source
    if "/" not in source and under.is_dir():
        return _best_of(under, source)
    raise ConfigError(
        f"train.init_from={source!r}: no such weights file, run folder, or run under "
        f"{workdir / 'runs'}; give a .pt file, a run folder, a parent run id or "
        "models:/<name>/<version>"
    )


def _best_of(folder: Path, source: str) -> Path:
    best = folder / BEST
    if not best.is_file():
        raise ConfigError(
            f"train.init_from={source!r}: {folder} has no {BEST} (the run never finished an "
            "epoch); give one of its checkpoints/epoch-*.pt instead"
        )
    return best.resolve()


def _registered(source: str, workdir: Path, tracking_uri: str | None) -> Path:
    """The weights of a registered version: its evaluate run's parent's run folder's best."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    name, _, version = source.removeprefix("models:/").rpartition("/")
    if not name or not version.isdigit():
        raise ConfigError(f"train.init_from={source!r}: write models:/<name>/<version number>")
    client = MlflowClient(tracking_uri)
    try:
        run_id = client.get_model_version(name, version).run_id
        parent = client.get_run(str(run_id)).data.tags.get("mlflow.parentRunId")
    except MlflowException as err:
        first = str(err).splitlines()[0][:200]
        raise ConfigError(f"train.init_from={source!r}: {first}") from None
    if not parent:
        raise ConfigError(f"train.init_from={source!r}: version {version} has no pipeline run")
    return resolve(str(parent), workdir, tracking_uri)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights in a checkpoint or best-model file, on the CPU."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"train.init_from: {path} is not a weights file ({err})") from None
    weights = state.get("model") if isinstance(state, dict) else None
    if not isinstance(weights, dict):
        raise ConfigError(f"train.init_from: {path} holds no 'model' weights")
    return weights


def check_fits(weights: dict[str, Any], model: nn.Module, path: Path) -> None:
    """ConfigError naming what differs when `weights` do not fit `model` (meta is enough)."""
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    given = {k: tuple(v.shape) for k, v in weights.items()}
    missing = sorted(wanted.keys() - given.keys())
    extra = sorted(given.keys() - wanted.keys())
    shapes = [f"{k} {given[k]} vs {wanted[k]}" for k in sorted(wanted.keys() & given.keys())
              if given[k] != wanted[k]]  # fmt: skip
    if missing or extra or shapes:
        parts = [
            f"{label}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
            for label, items in (("missing", missing), ("unexpected", extra), ("shape", shapes))
            if items
        ]
        raise ConfigError(
            f"train.init_from: the weights in {path} do not fit this model ({'; '.join(parts)});"
            " start from a run of the same train.model and model_args"
        )


def initialised(model: nn.Module, path: str | None) -> nn.Module:
    """`model` with the weights of `path` (a resolved weights file) loaded, when given; a
    model built on the meta device (an FSDP rank other than 0) is left as it is."""
    if path is None or any(p.is_meta for p in model.parameters()):
        return model
    model.load_state_dict(load_weights(Path(path)))
    return model
