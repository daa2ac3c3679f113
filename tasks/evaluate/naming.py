"""The registered model's default name: the model and the objective, `<model>-<objective>`.

`gpt2-sequence` (train.model=hf: the architecture's model_type), `mlp-regression`,
`reference_cnn-classification` (built-ins and entry points: their name), `char_transformer-
sequence` (an import path 'package.module:factory': the module's last part). Characters a
registered name may not hold become '-'. `evaluate.registered_model` set to a name overrides it.
"""

import re

from torch import nn

from trainflow.tasks.train.config import TrainConfig

AUTO = "auto"
"""evaluate.registered_model's value that asks for the default name."""
HF_FACTORIES = ("hf", "transformers")
"""Built-in factories whose models are named by their architecture (config.model_type)."""
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_.\-]")


def default_name(train: TrainConfig, model: nn.Module) -> str:
    """`<model>-<objective>` for the model `train` built (`model`)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if train.model in HF_FACTORIES and isinstance(model_type, str):
        what = model_type
    else:
        what = _short(train.model, module=True)
    name = f"{what}-{_short(train.objective, module=False)}"
    return _NOT_ALLOWED.sub("-", name).strip("-._") or "model"


def _short(ref: str, module: bool) -> str:
    """A plug-in reference's short name: a built-in's or entry point's name as it is; of an
    import path, the module's last part (`module`) or the object's name, lower case."""
    path, sep, obj = ref.partition(":")
    if not sep:
        return ref
    return path.rsplit(".", 1)[-1] if module else obj.lower()
