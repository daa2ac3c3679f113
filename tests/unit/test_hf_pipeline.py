"""Pipeline stages for Hugging Face models (train.model=hf, train.parallel.pp): transformers'
own pipeline plan for the architecture cut into stages that keep the whole model's names and
compute the whole model's logits, refused in one line where it cannot apply (no plan: GPT-2,
BERT; a decoder the stages do not compute; a classifier; layers pp does not divide; tied
weights), and a tiny Llama (4 layers, 2 a stage) trained with pp=2 on 2 ranks, and pp=2 x
tp=2 on 4, as on one rank, and with pp=2 x dp_shard=2 on 4 as with DDP on 2.

The runs' bound, and why: as tests/unit/test_pipeline_parallel.py's (the same function, its
sums grouped differently: each stage's gradient the sum of its micro-batches' backward passes,
the clipping norm the root of the stages' summed squares; with tp, the row-wise sums split
over 2 ranks: rounding differences of ~1e-7 relative in fp32 per step). Measured over these
12 steps: losses and gradient norms within 1.5e-8 relative (pp=2), 7.7e-8 (pp=2 x tp=2) and
5.9e-8 (pp=2 x dp_shard=2), weights within 1.2e-7 absolute (one float32 step at 1: the norms'
weights, near 1; the others are drawn with std 0.02). Bound: 1e-6 for all, eight times the
larger. The
stages' logits against the whole model's forward: equal here (0.0), held within 1e-6.
"""

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from transformers import LlamaForCausalLM

from tests.unit.datasets import write_token_dataset
from tests.unit.test_hf_tensor_parallel import CONTEXT, LLAMA, TOKENS, VOCAB, meta_model
from tests.unit.test_hf_tensor_parallel import train as train_llama
from tests.unit.test_pipeline_parallel import BOUND, assert_same_training
from tests.unit.test_pipeline_stages import preflight
from trainflow.errors import ConfigError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.hf_models import transformers_model
from trainflow.tasks.train.parallel.hf_stages import DECODERS
from trainflow.tasks.train.parallel.pipeline import check_stages, stage_module
from trainflow.tasks.train.parallel.tensor_parallel import how_to_split

LAYERS = {**LLAMA, "num_hidden_layers": 4}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}
LABELS = DataSpec((CONTEXT,), "int64", "classification", 3, ())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_llamas_stages_hold_its_plans_modules_under_their_names_and_give_its_logits(
    attention: str,
) -> None:
    """Under eager attention the causal mask is a tensor each stage makes (under SDPA, None:
    the kernel's own causal mask)."""
    torch.manual_seed(0)
    model = transformers_model(TOKENS, **LAYERS, attn_implementation=attention)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config._attn_implementation == attention
    check_stages(model, 2)
    first, last = (stage_module(model, s, 2) for s in range(2))
    first_names = {n.rsplit(".", 1)[0] for n, _ in first.named_parameters()}
    assert "model.embed_tokens" in first_names and "lm_head" not in first_names
    layers = {n.split(".")[2] for n, _ in last.named_parameters() if n.startswith("model.layers")}
    assert layers == {"2", "3"}
    assert {"lm_head.weight", "model.norm.weight"} <= dict(last.named_parameters()).keys()
    keys = [set(stage.state_dict()) for stage in (first, last)]  # a checkpoint's, split
    assert not keys[0] & keys[1] and keys[0] | keys[1] == set(model.state_dict())
    # each stage computes the positions and rotary embeddings itself (buffers of the model's)
    assert dict(last.named_buffers()).keys() == {n for n, _ in model.named_buffers()}
    assert_stages_give_the_models_logits(model, [first, last])


@pytest.mark.parametrize("model_type", DECODERS)
def test_each_llama_like_decoders_stages_give_its_logits(model_type: str) -> None:
    """The architectures offered: 4 stages of one layer each, eager attention (the mask made
    by each stage)."""
    torch.manual_seed(0)
    args = {**LAYERS, "model_type": model_type, "head_dim": 16, "tie_word_embeddings": False}
    model = transformers_model(TOKENS, **args, attn_implementation="eager")
    check_stages(model, 4)
    assert_stages_give_the_models_logits(model, [stage_module(model, s, 4) for s in range(4)])


def assert_stages_give_the_models_logits(model: nn.Module, stages: list[nn.Module]) -> None:
    """The stages one after the other give the whole model's logits (its own forward)."""
    ids = torch.randint(0, VOCAB, (3, CONTEXT))
    with torch.no_grad():
        want = model(ids).logits
        got = ids
        for stage in stages:
            got = stage(got)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_stage_is_split_by_transformers_tp_plan_for_the_modules_it_holds() -> None:
    model = meta_model(**LAYERS)
    split = how_to_split(stage_module(model, 1, 2), 2)
    assert split.source == "transformers"
    modules = {n for n in split.plan if not n.endswith(".weight")}
    assert "lm_head" in modules and "model.embed_tokens" not in modules
    assert {m.split(".")[2] for m in modules if m.startswith("model.layers")} == {"2", "3"}
    assert split.plan["model.layers.3.self_attn.o_proj"] == "rowwise"


@pytest.mark.parametrize(
    ("spec", "args", "pp", "words"),
    [
        (TOKENS, GPT2, 2, "no pipeline plan for the gpt2"),
        (TOKENS, {**LLAMA, "model_type": "qwen2"}, 2, "the qwen2 model (Qwen2ForCausalLM)'s"),
        (TOKENS, {**LAYERS}, 3, "divide the llama model (LlamaForCausalLM)'s 4 layers"),
        (TOKENS, {**LAYERS, "tie_word_embeddings": True}, 2, "tie_word_embeddings=false"),
        (LABELS, {**LAYERS, "vocab_size": VOCAB}, 2, "not the logits"),
    ],
    ids=["no-plan", "not-llama", "layers", "tied", "classifier"],
)
def test_what_transformers_pp_plan_cannot_cut_is_one_line(
    spec: DataSpec, args: dict[str, Any], pp: int, words: str
) -> None:
    model = meta_model(spec, **args)
    with pytest.raises(ConfigError) as err:
        check_stages(model, pp)
    message = str(err.value)
    assert "\n" not in message and f"train.parallel.pp={pp}" in message
    assert words in message, message


def test_bert_has_no_pipeline_plan() -> None:
    bert = {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 40}
    model: nn.Module = meta_model(LABELS, **bert, num_attention_heads=4, intermediate_size=128)
    with pytest.raises(ConfigError, match=r"no pipeline plan for the bert model"):
        check_stages(model, 2)


def test_the_preflight_takes_a_llamas_stages_and_refuses_gpt2_before_any_job() -> None:
    preflight("hf", 2, **LAYERS)  # 2 layers a stage: no refusal
    with pytest.raises(ConfigError, match=r"pp=2: transformers has no pipeline plan for the gpt2"):
        preflight("hf", 2, **GPT2)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    root = tmp_path_factory.mktemp("tokens") / "ds"
    return write_token_dataset(root, context=CONTEXT, vocab=VOCAB, n_train=384, n_val=64)


@pytest.fixture(scope="module")
def one_rank(tokens: DatasetRef, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 4-layer Llama trained on one rank: what the split runs are held to."""
    out = tmp_path_factory.mktemp("one")
    return {**train_llama(tokens, out, 1, model_args=LAYERS), "last": last_checkpoint(out)}


def last_checkpoint(out: Path) -> Path:
    """The newest checkpoint of the run in `out` (a file, or DCP's folder under stages)."""
    return max(p for p in (out / "run" / "checkpoints").iterdir() if p.suffix != ".sha256")


@pytest.mark.services
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in one process
# pp=2 alone is the pp=2 x tp=2 case's stages and the pp=2 x dp_shard=2 test's schedule: not
# run on its own (the suite's time)
@pytest.mark.parametrize(("ranks", "parallel"), [(4, {"pp": 2, "tp": 2})], ids=["pp=2 x tp=2"])
def test_a_llama_cut_by_transformers_plan_trains_as_one_rank(
    tokens: DatasetRef,
    one_rank: dict[str, Any],
    tmp_path: Path,
    ranks: int,
    parallel: dict[str, int],
) -> None:
    """2 stages of 2 layers, 2 micro-batches of 8 (1F1B); with tp, each stage's layers split
    by transformers' tp plan over its 2 ranks."""
    split = train_llama(
        tokens, tmp_path / "split", ranks, model_args=LAYERS, strategy="fsdp", parallel=parallel
    )
    assert_same_training(split, one_rank)
    # The stages' sharded checkpoint (DCP) holds the whole model under transformers' names:
    # it loads into one plain Llama, with the weights of the one rank's last checkpoint.
    want = torch.load(one_rank["last"], weights_only=True)["model"]
    with torch.device("meta"):
        model = transformers_model(TOKENS, **LAYERS)
    state = {"model": model.to_empty(device="cpu").state_dict()}
    dcp.load(state, checkpoint_id=last_checkpoint(tmp_path / "split"), no_dist=True)
    assert state["model"].keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(state["model"][name], value, rtol=0, atol=BOUND, msg=name)


@pytest.mark.services
@pytest.mark.timeout(300)
def test_a_sharded_llama_pipeline_trains_as_ddp_on_the_same_global_batch(
    tokens: DatasetRef, tmp_path: Path
) -> None:
    """pp=2 x dp_shard=2 on 4 ranks (FSDP2 shards each stage's decoder layers over its 2
    data-parallel ranks) against DDP on 2 ranks: the same samples each optimizer step."""
    ddp = train_llama(tokens, tmp_path / "ddp", 2, model_args=LAYERS, strategy="ddp")
    mesh = train_llama(
        tokens, tmp_path / "mesh", 4, model_args=LAYERS, strategy="fsdp", parallel={"pp": 2}
    )
    assert_same_training(mesh, ddp)
