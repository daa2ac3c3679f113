"""Pipeline stages for Hugging Face `transformers` models: the library's own pipeline plan for
the architecture, cut into stages by layer (tasks.train.parallel.pipeline's `stage_module`
takes it for a transformers model, which has no `pp_split` of its own).

Where the plan comes from: an architecture's config names the modules of its base model a
pipeline passes through, in order, with their inputs and outputs (``base_model_pp_plan``:
Llama's ``embed_tokens`` input_ids -> inputs_embeds, ``layers`` hidden_states (with the
attention mask) -> hidden_states, ``norm`` hidden_states -> hidden_states), its task head adds
its own (``_pp_plan``: the causal LM's ``lm_head`` hidden_states -> logits), and the model's
`pp_plan` property holds the two under the whole model's names (``model.embed_tokens``,
``model.layers``, ``model.norm``, ``lm_head``).

The cut (`hf_stage`): the plan's layer list split into equal, consecutive shares; the plan's
modules before it on the first stage, those after it on the last. A stage (`HFStage`) holds
its modules under their names in the whole model (``model.layers.2.self_attn.q_proj.weight``
keeps its name: checkpoints and best.pt are keyed as the whole model's), and computes between
them what the decoder's forward computes (LlamaModel.forward): the positions 0..T-1, the
rotary position embeddings of the base model's ``rotary_emb`` (a module every stage holds:
buffers, no parameters), and the causal mask of transformers' `create_causal_mask`
for the config's attention implementation (None under SDPA without padding: its causal
kernel). transformers' own `apply_pipeline_parallelism` is not used: it replaces the other
stages' modules in the model itself and runs its own naive send/recv forward, where
trainflow's schedule (torch.distributed.pipelining's 1F1B) needs a module per stage.

What the decoder's forward computes between the plan's modules is the architecture's code,
not its plan (Mistral and Qwen2 choose sliding-window masks there, Granite scales the
embeddings and the logits, Cohere the logits): the stages compute Llama's, and are offered
for the architectures whose decoder and causal LM forward are Llama's line for line in
transformers 5.24 (`DECODERS`; tests/unit/test_hf_pipeline.py holds each one's stages' logits
equal to the whole model's under eager attention, Llama's under SDPA too). Refused in one line
each, before anything is queued: an architecture without a plan (GPT-2 and BERT in
transformers 5.24), one whose decoder the stages do not compute, a plan that does not end in
logits (a sequence classifier: its pooling is outside the plan), layers that do not divide by
pp, and an input embedding tied to the output layer (the first and the last stage would each
train its own copy).

Tensor parallelism within a stage (pp x tp): a stage offers the whole model's transformers
plan (its `tp_plan`, the property a transformers model has), which tasks.train.parallel.hf_plan
spells out for the modules the stage holds and applies with transformers' own styles.
"""

from typing import Any

import torch
from torch import nn

from trainflow.errors import ConfigError

DECODERS = ("llama", "gemma", "olmo", "olmo2", "helium", "glm", "arcee")
"""Model types whose decoder forward, between the modules of their pipeline plan, is Llama's
(positions, rotary embeddings, one causal mask for every layer), as is their causal LM's
(the head on the last hidden states): read in transformers 5.24's modeling files."""
LAYER_EXTRAS = {"attention_mask"}
"""The plan's layer inputs besides hidden_states that a stage computes itself."""


def hf_stage(model: nn.Module, stage: int, stages: int) -> "HFStage":
    """Stage `stage` of `stages` of the transformers causal LM `model`, by its pipeline plan
    (module docstring); ConfigError (one line) when it cannot be cut."""
    before, layers, after = plan_parts(model, stages)
    per = len(_layer_list(model, layers)) // stages
    owned = range(stage * per, (stage + 1) * per)
    return HFStage(
        model, layers, owned, before if stage == 0 else [], after if stage == stages - 1 else []
    )


def plan_parts(model: nn.Module, stages: int) -> tuple[list[str], str, list[str]]:
    """The plan's modules of `model` in the model's order, as (those before the layer list, the
    layer list, those after it), checked for a cut into `stages` stages (ConfigError)."""
    config = getattr(model, "config", None)
    kind = f"{getattr(config, 'model_type', '?')} model ({type(model).__name__})"
    plan: dict[str, Any] = dict(getattr(model, "pp_plan", None) or {})
    if not plan:
        raise ConfigError(
            f"train.parallel.pp={stages}: transformers has no pipeline plan for the {kind}: use "
            "an architecture whose config has one (base_model_pp_plan: llama), a model of your "
            "own with a method pp_split(self, stage, stages), or set train.parallel.pp=1"
        )
    if getattr(config, "model_type", None) not in DECODERS:
        raise ConfigError(
            f"train.parallel.pp={stages}: trainflow's stages of a transformers model compute "
            f"Llama's decoder between its plan's modules, which the {kind}'s does not: use a "
            f"model_type of {', '.join(DECODERS)}, a model of your own with a method "
            "pp_split(self, stage, stages), or set train.parallel.pp=1"
        )
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    names = sorted(plan, key=lambda n: order.get(n, -1))
    if names[-1] not in order or plan[names[-1]][1] != ["logits"]:
        raise ConfigError(
            f"train.parallel.pp={stages}: transformers' pipeline plan for the {kind} ends in "
            f"{plan[names[-1]][1]}, not the logits (its head is outside the plan): use a causal "
            "language model (train.objective=sequence), or set train.parallel.pp=1"
        )
    lists = [n for n in names if isinstance(model.get_submodule(n), nn.ModuleList)]
    assert len(lists) == 1, f"{kind}: a pipeline plan with layer lists {lists}"
    layers = lists[0]
    extras = set(plan[layers][0][1:])
    assert extras <= LAYER_EXTRAS, f"{kind}: layers take {extras}"
    count = len(_layer_list(model, layers))
    if count % stages:
        raise ConfigError(
            f"train.parallel.pp={stages} does not divide the {kind}'s {count} layers: set "
            f"train.parallel.pp to a divisor of {count}, or train.model_args.num_hidden_layers"
        )
    _check_untied(model, names, kind, stages)
    i = names.index(layers)
    return names[:i], layers, names[i + 1 :]


def _check_untied(model: nn.Module, names: list[str], kind: str, stages: int) -> None:
    """ConfigError when a weight is shared between modules of the plan (a tied input
    embedding and output layer): the stages holding them would train two copies."""
    owner: dict[int, str] = {}
    for name in names:
        for param in model.get_submodule(name).parameters():
            first = owner.setdefault(id(param), name)
            if first != name:
                raise ConfigError(
                    f"train.parallel.pp={stages}: the {kind}'s {first} and {name} share one "
                    "weight (tie_word_embeddings), which pipeline stages would place on two "
                    "ranks: set train.model_args.tie_word_embeddings=false, or "
                    "train.parallel.pp=1"
                )


class HFStage(nn.Module):
    """One pipeline stage of a transformers causal LM: the plan's modules `before` its layers
    (first stage), its layers `owned` of the list at `layers` (a ModuleDict keyed by their
    index in the whole model), the base model's rotary embedding, and the plan's modules
    `after` the layers (last stage), each under its name in the whole model."""

    def __init__(
        self, model: nn.Module, layers: str, owned: range, before: list[str], after: list[str]
    ) -> None:
        super().__init__()
        self.config = model.config
        """The whole model's config (the mask's attention implementation; tp's checks)."""
        self._tp_plan: dict[str, str] = dict(getattr(model, "tp_plan", None) or {})
        whole = _layer_list(model, layers)
        self._before, self._after = before, after
        self._layers = layers
        self._owned = [str(i) for i in owned]
        for name in before:
            _place(self, name, model.get_submodule(name))
        _place(self, layers, nn.ModuleDict({k: whole[int(k)] for k in self._owned}))
        for name in after:
            _place(self, name, model.get_submodule(name))
        self._rotary = f"{layers.rpartition('.')[0]}.rotary_emb".lstrip(".")
        _place(self, self._rotary, model.get_submodule(self._rotary))

    @property
    def tp_plan(self) -> dict[str, str]:
        """The whole model's transformers tensor-parallel plan (patterns by module name), as a
        transformers model offers it: tasks.train.parallel.hf_plan spells it out for the
        modules this stage holds."""
        return self._tp_plan

    def shard_units(self) -> list[nn.Module]:
        """The stage's decoder layers: train.strategy=fsdp shards each on its own."""
        return list(self._blocks().values())

    def _blocks(self) -> nn.ModuleDict:
        blocks = self.get_submodule(self._layers)
        assert isinstance(blocks, nn.ModuleDict)
        return blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or the previous stage's hidden states (batch, T, hidden) ->
        hidden states, or the logits on the last stage."""
        from transformers.masking_utils import create_causal_mask

        for name in self._before:
            x = self.get_submodule(name)(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=x,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        rotary = self.get_submodule(self._rotary)(x, position_ids=positions)
        for layer in self._blocks().values():
            x = layer(x, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        for name in self._after:
            x = self.get_submodule(name)(x)
        return x


def is_hf_stage(module: nn.Module) -> bool:
    """True for a stage of a transformers model (HFStage)."""
    return isinstance(module, HFStage)


def _layer_list(model: nn.Module, name: str) -> nn.ModuleList:
    """The layer list of `model`'s pipeline plan at `name`."""
    layers = model.get_submodule(name)
    assert isinstance(layers, nn.ModuleList), (name, type(layers))
    return layers


def _place(root: nn.Module, name: str, module: nn.Module) -> None:
    """`module` at the dotted `name` under `root`, with empty containers along the path."""
    *path, leaf = name.split(".")
    for part in path:
        child = getattr(root, part, None)
        if child is None:
            child = nn.Module()
            root.add_module(part, child)
        root = child
    root.add_module(leaf, module)
