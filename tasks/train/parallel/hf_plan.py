"""Tensor parallelism for Hugging Face `transformers` models: the library's own plan for the
architecture, checked against the model's sizes and applied with transformers' own parallel
styles.

Where the plan comes from: an architecture's config names how its base model splits
(``base_model_tp_plan``: Llama's attention projections q/k/v column-wise and o row-wise, its
MLP's gate/up column-wise and down row-wise), its task head adds its own (``_tp_plan``: the
causal LM's ``lm_head`` column-wise, gathered), and the model's `tp_plan` property holds the
two together, with the input embedding split over the vocabulary (``embedding_rowwise``).
Patterns name layers by number with ``*`` (``model.layers.*.self_attn.q_proj``).

How it is applied: `transformers.distributed.tensor_parallel.apply_tensor_parallelism(model,
tp_mesh, plan)`, the function transformers' own loading (``from_pretrained(...,
distributed_config=...)``) applies its plans with, over the mesh's `tp` dimension of a model
trainflow built. It takes the plan spelled out per module and parameter
(``model.layers.0.self_attn.q_proj.weight``: the parameters a style shards, then the module
whose forward it wraps): `expanded_plan` spells it out as transformers' loading does
(tests/unit/test_hf_tensor_parallel.py holds the two equal). Weights are split locally, with
no collective (as `src_data_rank=None` for our own plans); rank 0's weights fill the shards
afterwards (tasks.train.sharded_init).

What is refused, in one line each, before anything is queued (`check_hf`): an architecture
without a plan (GPT-2 and BERT in transformers 5.24), attention heads or key/value heads that
do not divide by tp, a split layer whose width does not (the vocabulary, the MLP's
intermediate size), and weights shared between layers the plan splits apart (a tied input
embedding and output layer, ``tie_word_embeddings``).
"""

from typing import TYPE_CHECKING, Any

from torch import nn

from trainflow.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

OUTPUTS, INPUTS = ("out_features", "outputs"), ("in_features", "inputs")
WIDTHS = {
    "colwise": OUTPUTS,
    "colwise_gather_output": OUTPUTS,
    "colwise_rep": OUTPUTS,
    "packed_colwise": OUTPUTS,
    "rowwise": INPUTS,
    "rowwise_split_input": INPUTS,
    "rowwise_rep": INPUTS,
    "packed_rowwise": INPUTS,
    "embedding_rowwise": ("num_embeddings", "token rows"),
    "embedding_colwise": ("embedding_dim", "dimensions"),
}
"""The size each of transformers' parallel styles splits a module along (the module's
attribute, and its words in a refusal); styles not named here are not checked for it."""
HEADS = (("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads"))
"""The config's head counts, which a split of the attention projections divides among ranks."""
SIZE_KEYS = ("vocab_size", "intermediate_size", "hidden_size")
"""Config keys that may name a split layer's width (said in the refusal)."""


def library_plan(model: nn.Module) -> dict[str, str]:
    """transformers' plan for `model` as it names it (its `tp_plan` property: style names by
    module pattern), {} when the architecture has none."""
    return dict(getattr(model, "tp_plan", None) or {})


def expanded_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan` spelled out for `model`: for each module in order, its own parameters that a rule
    names (its own rule, or its module's) and then the module itself when a rule names it;
    layer numbers matched by ``*`` (transformers' `replace_layer_number_by_wildcard`)."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    spelled: dict[str, str] = {}
    for name, module in model.named_modules():
        generic = replace_layer_number_by_wildcard(name)
        for param, _ in module.named_parameters(recurse=False):
            full = f"{name}.{param}" if name else param
            style = plan.get(replace_layer_number_by_wildcard(full), plan.get(generic))
            if style is not None:
                spelled[full] = style
        if generic in plan:
            spelled[name] = plan[generic]
    return spelled


def check_hf(model: nn.Module, tp: int) -> dict[str, str]:
    """transformers' plan for `model` over `tp` ranks, spelled out (expanded_plan), after the
    checks that refuse it in one line (ConfigError): no plan, heads or a split width that `tp`
    does not divide, a weight shared between split layers. Works on a meta-device model."""
    config = getattr(model, "config", None)
    kind = f"{getattr(config, 'model_type', '?')} model ({type(model).__name__})"
    plan = library_plan(model)
    if not plan:
        raise ConfigError(
            f"train.parallel.tp={tp}: transformers has no tensor-parallel plan for the {kind}: "
            "use an architecture whose config has one (base_model_tp_plan: llama, mistral, "
            "qwen2...), a model of your own with a method tp_plan(self, tp), or set "
            "train.parallel.tp=1"
        )
    _check_heads(config, kind, tp)
    spelled = expanded_plan(model, plan)
    if not spelled:
        raise ConfigError(
            f"train.parallel.tp={tp}: transformers' plan for the {kind} names no layer of the "
            f"model ({sorted(plan)}): set train.parallel.tp=1"
        )
    _check_widths(model, spelled, config, kind, tp)
    _check_shared(model, spelled, kind, tp)
    return spelled


def apply_hf(model: nn.Module, tp_mesh: "DeviceMesh", spelled: dict[str, str]) -> nn.Module:
    """`model` with transformers' plan `spelled` (check_hf) applied over `tp_mesh`, in place,
    by transformers' own parallel styles."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    return apply_tensor_parallelism(model, tp_mesh, spelled)


def _check_heads(config: Any, kind: str, tp: int) -> None:
    for key, what in HEADS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value % tp:
            raise ConfigError(
                f"train.parallel.tp={tp} does not divide the {kind}'s {value} {what}: set "
                f"train.parallel.tp to a divisor of {value}, or train.model_args.{key}"
            )


def _check_widths(
    model: nn.Module, spelled: dict[str, str], config: Any, kind: str, tp: int
) -> None:
    modules = dict(model.named_modules())
    for name, style in spelled.items():
        attribute, words = WIDTHS.get(style, ("", ""))
        width = getattr(modules.get(name), attribute, None) if attribute else None
        if not isinstance(width, int) or width % tp == 0:
            continue
        key = next((k for k in SIZE_KEYS if getattr(config, k, None) == width), None)
        fix = f"set train.parallel.tp to a divisor of {width}"
        if key == "vocab_size":
            fix += " (the vocabulary is the data's)"
        elif key is not None:
            fix += f", or train.model_args.{key}"
        raise ConfigError(
            f"train.parallel.tp={tp} does not divide the {width} {words} of the {kind}'s "
            f"{name} ({style}{', ' + key if key else ''}): {fix}"
        )


def _check_shared(model: nn.Module, spelled: dict[str, str], kind: str, tp: int) -> None:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for group in names.values():
        if len(group) > 1 and any(n in spelled for n in group):
            raise ConfigError(
                f"train.parallel.tp={tp}: the {kind}'s {' and '.join(group)} are one weight "
                "(tied, tie_word_embeddings), which transformers' plan splits as separate "
                "layers: set train.model_args.tie_word_embeddings=false, or "
                "train.parallel.tp=1"
            )
