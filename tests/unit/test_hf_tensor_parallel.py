"""Tensor parallelism for Hugging Face models (train.model=hf): transformers' own plan for the
architecture, spelled out as transformers' loading spells it, refused in one line where it
cannot apply (no plan: GPT-2, BERT; heads or widths tp does not divide; tied weights), and a
tiny Llama trained with tp=2 on 2 ranks as on one.

The run's bound, and why: as tests/unit/test_tensor_parallel.py's tp=2 against one rank (the
same function, its row-wise sums split over 2 ranks: rounding differences of ~1e-7 relative in
fp32 per step); transformers' Llama plan splits the attention and MLP projections, the input
embedding over the vocabulary and the output layer, with no sequence parallelism. Measured
over these 12 steps: losses and gradient norms within 9.1e-8 relative, weights within 1.5e-8
absolute (weights drawn with std 0.02, norms near 1). Bound: 1e-6 for both, ten times the
larger.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import DistributedConfig, LlamaForCausalLM

from tests.unit.datasets import write_token_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.hf_models import transformers_model
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.parallel.tensor_parallel import check_tp, how_to_split, tp_plan
from trainflow.tasks.train.ref import CheckpointRef

CONTEXT, VOCAB = 32, 40
TOKENS = DataSpec((CONTEXT,), "int64", "sequence", VOCAB, (CONTEXT,))
LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}
BOUND = 1e-6
CLIP = 0.5


def meta_model(spec: DataSpec = TOKENS, **args: Any) -> nn.Module:
    """The model train.model=hf builds for `spec` from `args`, on the meta device (as the
    preflight builds it)."""
    with torch.device("meta"):
        return transformers_model(spec, **args)


def test_llamas_plan_is_transformers_own_spelled_out_as_its_loading_does() -> None:
    model = meta_model(**LLAMA)
    split = how_to_split(model, 2)
    assert split.source == "transformers"
    projections = [
        f"model.layers.{i}.{p}"
        for i in range(2)
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    modules = {"model.embed_tokens", "lm_head", *projections}
    assert {n for n in split.plan if not n.endswith(".weight")} == modules
    assert {n for n in split.plan if n.endswith(".weight")} == {f"{m}.weight" for m in modules}
    assert split.plan["model.embed_tokens"] == "embedding_rowwise"
    assert split.plan["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert split.plan["lm_head"] == "colwise_gather_output"
    # transformers' own loading (from_pretrained(distributed_config=...)) spells the plan out
    # with its private _resolve_parallel_plans: the same entries, in the same order (a
    # parameter before its module). Fails when transformers changes how it reads a plan.
    assert isinstance(model, LlamaForCausalLM)
    own, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
    assert list(split.plan.items()) == list(own.items())


def test_a_models_own_plan_comes_before_transformers() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    class Own(LlamaForCausalLM):
        def tp_plan(self, tp: int) -> dict[str, object]:  # type: ignore[override]
            return {"lm_head": ColwiseParallel()}

    llama = meta_model(**LLAMA)
    assert isinstance(llama, LlamaForCausalLM)
    with torch.device("meta"):
        own = Own(llama.config)
    assert how_to_split(own, 2).source == "Own.tp_plan(2)"
    assert list(tp_plan(own, 2)) == ["lm_head"]


@pytest.mark.parametrize(
    ("args", "tp", "words"),
    [
        ({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}, 2, "plan for the gpt2"),
        ({**LLAMA, "num_attention_heads": 4}, 3, "(LlamaForCausalLM)'s 4 attention heads"),
        ({**LLAMA, "num_key_value_heads": 2}, 4, "2 key/value heads"),
        ({**LLAMA, "intermediate_size": 129}, 2, "train.model_args.intermediate_size"),
        ({**LLAMA, "tie_word_embeddings": True}, 2, "tie_word_embeddings=false"),
    ],
    ids=["no-plan", "heads", "kv-heads", "intermediate", "tied"],
)
def test_what_transformers_plan_cannot_split_is_one_line(
    args: dict[str, Any], tp: int, words: str
) -> None:
    model = meta_model(**args)
    with pytest.raises(ConfigError) as err:
        check_tp(model, tp)
    message = str(err.value)
    assert "\n" not in message and f"train.parallel.tp={tp}" in message
    assert words in message, message


def test_a_vocabulary_tp_does_not_divide_is_refused_naming_it() -> None:
    spec = DataSpec((CONTEXT,), "int64", "sequence", 41, (CONTEXT,))
    with pytest.raises(ConfigError, match=r"41 token rows .*model.embed_tokens.*vocab_size"):
        check_tp(meta_model(spec, **LLAMA), 2)


def test_bert_has_no_plan_and_tp_1_needs_none() -> None:
    spec = DataSpec((CONTEXT,), "int64", "classification", 3, ())
    bert = {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 40}
    model = meta_model(spec, **bert, num_attention_heads=4, intermediate_size=128)
    with pytest.raises(ConfigError, match=r"no tensor-parallel plan for the bert model"):
        check_tp(model, 2)
    check_tp(model, 1)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    root = tmp_path_factory.mktemp("tokens") / "ds"
    return write_token_dataset(root, context=CONTEXT, vocab=VOCAB, n_train=384, n_val=64)


def train(
    tokens: DatasetRef, out: Path, ranks: int, model_args: dict[str, Any] = LLAMA, **keys: Any
) -> dict[str, Any]:
    """The tiny Llama (`model_args`) trained on `ranks` local ranks; its history and best.pt's
    weights."""
    cfg = TrainConfig(
        model="hf",
        model_args=model_args,
        objective="sequence",
        device="cpu",
        precision="fp32",
        max_steps=12,
        batch_size=16,
        optimizer="sgd",
        lr=0.1,
        max_grad_norm=CLIP,
        val_every_steps=6,
        test_after_training=False,
        **keys,
    )
    spec = TrainJobSpec(train=cfg, dataset=tokens, out_dir=out / "run")
    executor = make_executor(ClusterConfig(ranks_per_node=ranks, timeout_min=10), out / "jobs")
    ref = wait_for_job(executor.submit(TrainingJob(spec)), lambda line: None, 0.2)
    assert isinstance(ref, CheckpointRef)
    return {
        "history": json.loads(ref.history_path.read_text()),
        "best": torch.load(ref.path, weights_only=True)["model"],
    }


@pytest.mark.services
@pytest.mark.timeout(300)
def test_a_llama_split_by_transformers_plan_on_2_ranks_trains_as_one_rank(
    tokens: DatasetRef, tmp_path: Path
) -> None:
    one = train(tokens, tmp_path / "one", 1)
    tp = train(tokens, tmp_path / "tp", 2, strategy="fsdp", parallel={"tp": 2})
    assert [h["step"] for h in tp["history"]] == [h["step"] for h in one["history"]] == [6, 12]
    for g, w in zip(tp["history"], one["history"], strict=True):
        for key in ("train_loss", "val_loss", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=BOUND), (key, g, w)
        assert g["grad_norm"] > CLIP  # clipped: the norm over both ranks' halves counts
    assert tp["best"].keys() == one["best"].keys()
    for name, value in one["best"].items():
        torch.testing.assert_close(tp["best"][name], value, rtol=0, atol=BOUND, msg=name)
