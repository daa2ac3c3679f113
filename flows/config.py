"""The pipeline config: component configs composed, named presets, dotted overrides.

Presets are small Python definitions derived from the base (no YAML trees). Overrides are
``dotted.key=value`` strings; values are parsed as JSON when they parse, else taken as text.
Everything is validated here, before any work starts.
"""

import difflib
import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from trainflow.cluster.config import ClusterConfig
from trainflow.config_base import StrictModel, submodel
from trainflow.errors import ConfigError
from trainflow.tasks.evaluate.config import EvaluateConfig
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.train.config import TrainConfig


class PipelineConfig(StrictModel):
    """One whole pipeline run: preprocess -> train -> evaluate, and where it all runs."""

    name: str = Field("pipeline", min_length=1, max_length=100)
    """Name of the run (MLflow parent run name)."""
    workdir: Path = Path("trainflow-work")
    """Folder for datasets, checkpoints, job logs and the default MLflow store."""
    preprocess: PreprocessConfig = PreprocessConfig()
    """The preprocessing stage."""
    train: TrainConfig = TrainConfig()
    """The training stage."""
    evaluate: EvaluateConfig = EvaluateConfig()
    """The evaluation stage."""
    cluster: ClusterConfig = ClusterConfig()
    """Where the stages run."""
    tracking: TrackingConfig = TrackingConfig()
    """Where the runs are logged."""


def _demo() -> dict[str, Any]:
    # The bundled MNIST subset, 2 CPU ranks: reaches >= 0.9 test accuracy in well under a minute.
    return {"name": "demo", "preprocess": {"source": "mnist"}, "train": {"epochs": 8}}


def _tiny() -> dict[str, Any]:
    # Seconds, for tests: small learnable synthetic data, 2 ranks, 2 epochs.
    return {
        "name": "tiny",
        "preprocess": {"source": "synthetic", "synthetic_samples": 400, "shard_size": 128},
        "train": {"epochs": 2, "batch_size": 32, "lr": 5e-3},
        "evaluate": {"log_model": True},
        "tracking": {"system_metrics_interval_s": 1.0},  # a few samples in a short run
    }


def _resnet() -> dict[str, Any]:
    # The demo data with the small residual net instead of the reference CNN.
    cfg = _demo()
    cfg.update(name="resnet", train={"model": "resnet", "width": 16, "epochs": 6})
    return cfg


GPU_BATCH = 256
"""Batch size of the gpu preset: the reference CNN's steps on one H100 are launch-bound at the
demo's 64 (27,700 samples/s; 121,000 at 512), while 512 leaves 8 steps per epoch of the
demo's 4,000 images, too few to reach 0.95 at the demo's learning rate in 8 epochs (0.954)."""


def scaled_lr(batch_size: int, base_lr: float = 5e-3, base_batch: int = 64) -> float:
    """Learning rate for `batch_size`, scaled from the demo's (5e-3 at 64) by the square root
    of the batch ratio (the usual rule for Adam-type optimisers; linear scaling overshoots)."""
    return base_lr * (batch_size / base_batch) ** 0.5


def _gpu() -> dict[str, Any]:
    # The demo's data on one GPU rank with larger batches and the learning rate scaled to
    # them; more epochs, as each has 4x fewer steps. CUDA graphs stay off: at batch 512 on
    # the H100 their first epoch compiled for ~20 s, longer than this whole run trains.
    # On one CPU rank (fp32) this recipe reached 0.976 test accuracy in 12 epochs, 0.96 in 4.
    cfg = _demo()
    cfg.update(
        name="gpu",
        train={"epochs": 12, "batch_size": GPU_BATCH, "lr": scaled_lr(GPU_BATCH)},
        cluster={"ranks_per_node": 1, "gpus_per_node": 1},
    )
    return cfg


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "demo": _demo,
    "tiny": _tiny,
    "resnet": _resnet,
    "gpu": _gpu,
}
"""Named presets: each returns a partial config dict applied over the defaults."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and parsed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """Set the dotted `path` of a config tree to `value` (sections made as needed)."""
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {part!r} is not a section")
        node = child
    node[path[-1]] = value


def _valid_keys(model: type[StrictModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        section = submodel(field.annotation)
        if section is not None:
            keys += _valid_keys(section, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def validated(tree: dict[str, Any]) -> PipelineConfig:
    """The config of a tree (ConfigError with one line per mistake)."""
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err, lambda loc: None)) from None


def _format_error(err: ValidationError, where: Callable[[str], str | None]) -> str:
    """One line per mistake; `where(dotted key)` names the file:line that set it, if any."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            section = loc.rsplit(".", 1)[0] if "." in loc else ""
            near = [k for k in _valid_keys(PipelineConfig) if k.startswith(section)]
            leaf = loc.rsplit(".", 1)[-1]
            here = {k.rsplit(".", 1)[-1]: k for k in near if k.count(".") == loc.count(".")}
            like = difflib.get_close_matches(leaf, list(here), n=1)
            guess = f" (did you mean {here[like[0]]}?)" if like else ""
            text = f"{loc}: unknown key{guess}; valid keys here: {', '.join(near)}"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            text = f"{loc}: {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})")
        place = where(loc)
        lines.append(f"{place}: {text}" if place else text)
    return "invalid config:\n  " + "\n  ".join(lines)


def build_config(
    preset: str | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    experiment: Path | str | None = None,
) -> PipelineConfig:
    """Build and fully validate a pipeline config: a preset (`preset`, else the one the
    experiment file names, else demo), then the experiment file's keys, then dotted overrides.
    A mistake in the file is reported with its file and line."""
    from trainflow.flows.experiment import leaves, read

    exp = read(experiment) if experiment is not None else None
    name = preset or (exp.preset if exp else None) or "demo"
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    tree = PRESETS[name]()
    items = (
        [(k.split("."), v) for k, v in overrides.items()]
        if isinstance(overrides, Mapping)
        else [parse_override(o) for o in overrides]
    )
    from_file = leaves(exp.tree, PipelineConfig) if exp else {}
    for path, value in [(k.split("."), v) for k, v in from_file.items()] + items:
        set_path(tree, path, value)
    overridden = {".".join(path) for path, _ in items}

    def where(loc: str) -> str | None:
        if exp is None or any(loc == k or loc.startswith(k + ".") for k in overridden):
            return None  # a --set key: the command line, not the file
        return exp.where(loc)

    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err, where)) from None


def flatten(cfg: StrictModel, prefix: str = "") -> dict[str, str]:
    """The config as flat ``dotted.key -> text`` pairs (MLflow params)."""
    out: dict[str, str] = {}
    for key, value in cfg.model_dump(mode="json").items():
        _flatten_into(out, prefix + key, value)
    return out


def _flatten_into(out: dict[str, str], key: str, value: Any) -> None:
    if value == {}:  # no keys (train.model_args of a factory called without arguments)
        out[key] = "{}"
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten_into(out, f"{key}.{k}", v)
    else:
        out[key] = json.dumps(value) if isinstance(value, list | tuple) else str(value)


# What does not change the trained model stays out of config_hash: labels and places (name,
# workdir, where runs are logged), the evaluation (it measures the model, never makes it),
# preprocess.path (a location: the data's content is the dataset hash) and how often metrics
# are flushed. Of the cluster only the world shape counts (it sets the global batch, the data
# order and the device); where, how long and with which dask cluster it ran does not.
HASH_EXCLUDED = (
    "name",
    "workdir",
    "tracking",
    "evaluate",
    "preprocess.path",
    "train.log_every_epochs",
)
"""Dotted config keys that config_hash leaves out."""
HASH_CLUSTER_KEYS = ("nodes", "ranks_per_node", "gpus_per_node")
"""The only cluster keys config_hash covers."""


def config_hash(cfg: PipelineConfig) -> str:
    """Hex sha256 of the canonical JSON of the config fields that shape the trained model.

    Two runs with equal hashes trained the same recipe on data with the same content hash
    (tagged separately as dataset_hash). Adding a config field changes every hash once.
    """
    tree = cfg.model_dump(mode="json")
    tree["cluster"] = {k: tree["cluster"][k] for k in HASH_CLUSTER_KEYS}
    for key in HASH_EXCLUDED:
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        node.pop(leaf, None)
    text = json.dumps(tree, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


MAX_SWEEP = 256
"""Most elements a sweep may have (one job array)."""


def expand_grid(grid: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The cartesian product of a grid ``{"train.lr": [1e-3, 3e-3], ...}`` as override dicts.

    Only ``train.*`` keys may vary: a sweep shares one dataset and one job array with the
    same resources.
    """
    if not grid:
        raise ConfigError("a sweep needs a grid, e.g. --grid train.lr=[0.001,0.003]")
    for key, values in grid.items():
        if not key.startswith("train."):
            raise ConfigError(
                f"sweep key {key!r}: only train.* keys can vary in a sweep (one dataset, one "
                "job array); set other keys with --set"
            )
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep key {key!r} needs a non-empty list of values, got {values!r}")
    elements = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]
    if len(elements) > MAX_SWEEP:
        raise ConfigError(f"the grid has {len(elements)} elements; at most {MAX_SWEEP} are allowed")
    return elements


def build_sweep(
    preset: str | None,
    overrides: Iterable[str] | Mapping[str, Any],
    grid: Mapping[str, Any],
    experiment: Path | str | None = None,
) -> tuple[PipelineConfig, list[tuple[dict[str, Any], PipelineConfig]]]:
    """The base config (preset, experiment file, overrides: as `build_config`) and one
    validated config per grid element (all checked up front)."""
    base_items = dict(overrides) if isinstance(overrides, Mapping) else _as_mapping(overrides)
    base = build_config(preset, base_items, experiment)
    elements = []
    for i, element in enumerate(expand_grid(grid)):
        try:
            element_items = {**base_items, **element}
            elements.append((element, build_config(preset, element_items, experiment)))
        except ConfigError as err:
            raise ConfigError(f"sweep element {i} {element}: {err}") from None
    return base, elements


def _as_mapping(overrides: Iterable[str]) -> dict[str, Any]:
    return {".".join(path): value for path, value in map(parse_override, overrides)}
