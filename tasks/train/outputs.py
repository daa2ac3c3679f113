"""The one place a model's output becomes the logits tensor an objective reads.

A model's forward pass may return:

- a tensor: the logits (or values) themselves;
- a mapping with a ``logits`` entry: a dict, or a Hugging Face ``ModelOutput`` (which is a
  mapping; ``CausalLMOutputWithCrossAttentions`` and the like);
- a tuple or list whose first element is a tensor: that tensor (``return_dict=False`` models,
  or ``(logits, extras)``).

Training, evaluation, the first test pass, the meta-device check and the export all read the
output through `logits_of`, so a model trains as it is, without a wrapper.
"""

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

LOGITS_KEY = "logits"
"""The entry of a mapping output (dict, ModelOutput) read as the logits."""


class OutputError(TypeError):
    """A model output that holds no logits tensor; the message says what to return."""


def logits_of(output: Any) -> torch.Tensor:
    """The logits in `output` (a tensor, a mapping with 'logits', or a tuple whose first element
    is a tensor); OutputError (what was returned and what to return) otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        logits = output.get(LOGITS_KEY)
        if isinstance(logits, torch.Tensor):
            return logits
        keys = [str(k) for k in output]
        raise OutputError(
            f"returns {type(output).__name__} without a '{LOGITS_KEY}' tensor (keys {keys}): "
            f"return the logits tensor, or a dict or ModelOutput with a '{LOGITS_KEY}' entry"
        )
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    what = f"a {type(output).__name__}" if output is not None else "None"
    if isinstance(output, tuple | list):
        first = type(output[0]).__name__ if output else "nothing"
        what = f"a {type(output).__name__} whose first element is {first}"
    raise OutputError(
        f"returns {what}: return the logits tensor, a dict or ModelOutput with a "
        f"'{LOGITS_KEY}' entry, or a tuple whose first element is the logits"
    )


class LogitsOnly(nn.Module):
    """`model` whose forward returns logits_of(model(x)): what the pt2 export traces when the
    model returns more than a tensor, so the exported program gives one tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of `model` for `x`."""
        return logits_of(self.model(x))


def is_transformers_model(model: nn.Module) -> bool:
    """True for a `transformers.PreTrainedModel` (False without transformers imported: no model
    can be one then)."""
    module = sys.modules.get("transformers")
    return module is not None and isinstance(model, module.PreTrainedModel)
