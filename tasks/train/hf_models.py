"""The built-in factory `hf` (alias `transformers`): any Hugging Face `transformers` architecture,
built from a config or fine-tuned from a local `save_pretrained` folder.

`train.model_args`:

- ``model_type`` (e.g. "gpt2", "llama", "bert") and any keyword arguments of that
  architecture's config (``n_layer``, ``hidden_size``...): a new model, randomly initialised;
- ``pretrained``: a local folder written by ``save_pretrained`` (config.json and weights):
  the model starts from those weights (config keyword arguments given beside it override the
  saved config's, e.g. dropout); ``model_type``, when given too, must be the folder's.

The task follows the objective: ``sequence`` builds ``AutoModelForCausalLM`` (next-token logits
per position), ``classification`` of token ids ``AutoModelForSequenceClassification`` (one label
per sample, ``num_labels`` = the data's classes; ``vocab_size`` then comes from model_args or the
folder). Sizes that must agree with the data are taken from its DataSpec: the vocabulary is
``spec.num_classes`` for sequence data, and the context (``max_position_embeddings``, GPT-2's
``n_positions``) is at least ``spec.sample_shape[0]``; a value that disagrees is one line.

Nothing is fetched from the Hugging Face Hub: HF_HUB_OFFLINE is set before transformers loads
and folders are read with ``local_files_only``. On the meta device (the preflight check, the
ranks of an fsdp job that receive rank 0's weights) the model is built from the config alone.
``use_cache`` is off unless model_args set it: training never reads a key/value cache.
"""

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainflow.errors import ConfigError
from trainflow.tasks.spec import DataSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

EXTRA = "pip install trainflow[hf]"
"""How to install what this factory needs."""
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
"""Class-name endings of causal language models (GPT2LMHeadModel, LlamaForCausalLM...)."""


def transformers_model(
    spec: DataSpec,
    model_type: str | None = None,
    pretrained: str | None = None,
    **config_args: Any,
) -> nn.Module:
    """Factory of the built-in `hf`: a transformers model for `spec`'s token ids, from
    `model_type` and `config_args`, or from the `pretrained` folder."""
    auto = _auto_class(spec)
    config = _config(spec, model_type, pretrained, config_args)
    if pretrained is None or torch.get_default_device().type == "meta":
        model = auto.from_config(config)  # no weights to read: the meta build, or a new model
    else:
        model = auto.from_pretrained(
            pretrained, config=config, local_files_only=True, dtype=torch.float32
        )
    if pretrained is not None:
        _check_architecture(model, config, pretrained)
    return model


def _transformers() -> Any:
    """The transformers module, offline and quiet (ConfigError naming the extra without it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"train.model=hf needs the Hugging Face packages (transformers): {EXTRA}"
        ) from None
    transformers.logging.set_verbosity_error()  # the job log shows our stages, not its notes
    transformers.logging.disable_progress_bar()
    return transformers


def _auto_class(spec: DataSpec) -> Any:
    """AutoModelForCausalLM for sequence data, AutoModelForSequenceClassification for
    classification of token ids; ConfigError for other data."""
    transformers = _transformers()
    if spec.sample_dtype != "int64" or len(spec.sample_shape) != 1:
        raise ConfigError(
            f"train.model=hf reads token ids (n, T), but the data are {spec.sample_dtype} "
            f"samples shaped {spec.sample_shape}: tokenize the data, or use train.model=mlp "
            "or a model of your own"
        )
    if spec.objective == "sequence":
        return transformers.AutoModelForCausalLM
    if spec.objective == "classification":
        return transformers.AutoModelForSequenceClassification
    raise ConfigError(
        f"train.model=hf builds causal language models (train.objective=sequence) and "
        f"sequence classifiers (classification), not {spec.objective}: change train.objective"
    )


def _config(
    spec: DataSpec, model_type: str | None, pretrained: str | None, args: dict[str, Any]
) -> "PretrainedConfig":
    """The model's config: the folder's or model_type's, with `args` and the data's sizes."""
    transformers = _transformers()
    args = {"use_cache": False, **args}
    if pretrained is not None:
        folder = _pretrained_folder(pretrained)
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, **args)
        if model_type is not None and model_type != config.model_type:
            raise ConfigError(
                f"train.model_args.pretrained={pretrained!r} holds a {config.model_type} model, "
                f"but train.model_args.model_type={model_type!r}: point pretrained at a "
                f"{model_type} folder, or drop model_type"
            )
    elif model_type is None:
        raise ConfigError(
            "train.model=hf has no model to build: set train.model_args.model_type (e.g. "
            '"gpt2", "llama") with its config\'s keyword arguments, or '
            "train.model_args.pretrained=<a save_pretrained folder>"
        )
    else:
        try:
            config = transformers.AutoConfig.for_model(model_type, **args)
        except ValueError:
            raise ConfigError(
                f"train.model_args.model_type={model_type!r} is not a transformers architecture: "
                "use a model_type of transformers' configs (e.g. gpt2, llama, bert)"
            ) from None
    _fit_to_data(config, spec, args, pretrained)
    return config


def _pretrained_folder(pretrained: str) -> Path:
    """The folder `pretrained` names, checked to be a save_pretrained folder."""
    folder = Path(pretrained).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"train.model_args.pretrained={pretrained!r} is not a folder: set it to a folder "
            "written by save_pretrained (it is read locally; nothing is downloaded)"
        )
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"train.model_args.pretrained={pretrained!r} has no config.json: set it to a "
            "folder written by the model's save_pretrained(folder)"
        )
    return folder


def _fit_to_data(
    config: "PretrainedConfig", spec: DataSpec, args: dict[str, Any], pretrained: str | None
) -> None:
    """The vocabulary (sequence data), labels (classification) and context from `spec`;
    ConfigError where the config (given in `args`, or the folder's) disagrees."""
    where = "train.model_args.pretrained's config" if pretrained else "train.model_args"
    if spec.objective == "sequence":
        vocab = int(spec.num_classes or 0)
        if pretrained is None and "vocab_size" not in args:
            config.vocab_size = vocab
        elif config.vocab_size != vocab:
            fix = (
                "tokenize the data with the tokenizer the model was trained with"
                if pretrained
                else "drop model_args.vocab_size (it is taken from the data)"
            )
            raise ConfigError(
                f"{where} has vocab_size={config.vocab_size} but the data's vocabulary has "
                f"{vocab} ids: {fix}"
            )
        _tokens_in_vocabulary(config, vocab, args)
    else:
        config.num_labels = int(spec.num_classes or 0)
    context = spec.sample_shape[0]
    positions = getattr(config, "max_position_embeddings", None)
    given = {"max_position_embeddings", "n_positions"} & set(args)
    if positions is None:
        return  # no position table (relative or rotary positions of any length)
    if pretrained is None and not given:
        config.max_position_embeddings = context
    elif positions < context:
        raise ConfigError(
            f"{where} has a context of {positions} positions but the data's samples are "
            f"{context} tokens long: cut shorter windows in preprocessing, or drop the "
            "model_args' position size (it is taken from the data)"
        )


def _tokens_in_vocabulary(config: "PretrainedConfig", vocab: int, args: dict[str, Any]) -> None:
    """Special token ids of the architecture's defaults that fall outside a vocabulary taken
    from the data (GPT-2's 50256 in 256 byte ids) are unset, unless model_args gave them."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if name not in args and isinstance(value, int) and value >= vocab:
            setattr(config, name, None)


def _check_architecture(model: nn.Module, config: "PretrainedConfig", pretrained: str) -> None:
    """ConfigError when the folder's saved architecture is not the one the objective trains
    (a BertModel folder given to a causal language model would load with a new, random head)."""
    saved = list(getattr(config, "architectures", None) or [])
    built = type(model).__name__
    if saved and built not in saved:
        raise ConfigError(
            f"train.model_args.pretrained={pretrained!r} holds a {', '.join(saved)}, but "
            f"train.objective needs a {built}: save a {built} there (e.g. "
            f"{built}.from_pretrained(folder).save_pretrained(new_folder)), or point pretrained "
            "at a folder of that architecture"
        )
