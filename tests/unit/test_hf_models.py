"""Hugging Face models as they are: outputs read as logits (tensor, ModelOutput/dict, tuple),
the built-in factory `hf` (sizes from the DataSpec, fine-tuning from a local folder, one-line
refusals before any job), FSDP units from the model's `_no_split_modules`, the registered
model's default name. Real transformers models, tiny configs."""

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from trainflow.errors import ConfigError
from trainflow.tasks.evaluate.naming import default_name
from trainflow.tasks.plugins import PluginError
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model, check_model
from trainflow.tasks.train.outputs import OutputError, logits_of
from trainflow.tasks.train.sharding import sharding_units

CONTEXT, VOCAB = 16, 64
TOKENS = DataSpec((CONTEXT,), "int64", "sequence", VOCAB, (CONTEXT,))
GPT2: dict[str, Any] = {"model_type": "gpt2", "n_layer": 2, "n_embd": 16, "n_head": 2}
CHARLM = Path(__file__).parents[2] / "examples" / "charlm"
USER_MODELS = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, spec, returns):
        super().__init__()
        self.embed = nn.Embedding(spec.num_classes, spec.num_classes)
        self.returns = returns

    def forward(self, x):
        logits = self.embed(x)
        return {
            "dict": {"logits": logits, "aux": logits.sum()},
            "tuple": (logits, logits.sum()),
            "dict_without_logits": {"scores": logits},
            "tuple_of_lists": ([logits],),
            "none": None,
        }[self.returns]


def build(spec, returns):
    return Net(spec, returns)
"""


@pytest.fixture
def gpt2_folder(tmp_path: Path) -> Path:
    """A tiny GPT-2 for TOKENS saved with save_pretrained."""
    config = AutoConfig.for_model(vocab_size=VOCAB, n_positions=CONTEXT, **GPT2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


@pytest.fixture
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hf_user_models.py").write_text(USER_MODELS)
    yield
    sys.modules.pop("hf_user_models", None)


def test_logits_are_read_from_a_tensor_a_model_output_a_dict_and_a_tuple() -> None:
    t = torch.ones(2, 3)
    config = AutoConfig.for_model(vocab_size=VOCAB, n_positions=CONTEXT, **GPT2)
    model = AutoModelForCausalLM.from_config(config)
    output = model(torch.zeros(2, CONTEXT, dtype=torch.long))
    assert logits_of(t) is t and logits_of({"logits": t}) is t and logits_of((t, 3)) is t
    assert logits_of(output) is output.logits
    with pytest.raises(OutputError, match="without a 'logits' tensor"):
        logits_of({"scores": t})


@pytest.mark.parametrize("returns", ["dict", "tuple"])
def test_a_users_model_returning_a_dict_or_tuple_passes_the_check(
    user_models: None, returns: str
) -> None:
    cfg = TrainConfig(model="hf_user_models:build", model_args={"returns": returns})
    assert check_model(cfg, TOKENS).parameters == VOCAB * VOCAB


@pytest.mark.parametrize(
    ("returns", "said"),
    [
        ("dict_without_logits", "returns dict without a 'logits' tensor (keys ['scores'])"),
        ("tuple_of_lists", "returns a tuple whose first element is list"),
        ("none", "returns None"),
    ],
)
def test_outputs_without_logits_are_one_line_saying_what_to_return(
    user_models: None, returns: str, said: str
) -> None:
    cfg = TrainConfig(model="hf_user_models:build", model_args={"returns": returns})
    with pytest.raises(PluginError) as err:
        check_model(cfg, TOKENS)
    message = str(err.value)
    assert "\n" not in message and said in message, message
    assert "return the logits tensor, " in message and "(2, 16, 64)" in message, message
    assert "output layer" not in message  # the layer is fine: the return value is not


def test_the_factory_sizes_a_new_model_from_the_data_and_fsdp_shards_its_blocks() -> None:
    cfg = TrainConfig(model="hf", model_args=GPT2, strategy="fsdp")
    report = check_model(cfg, TOKENS)  # on the meta device
    model = build_model(cfg, TOKENS)
    assert isinstance(model, GPT2LMHeadModel)
    assert (model.config.vocab_size, model.config.n_positions) == (VOCAB, CONTEXT)
    assert model.config.use_cache is False and model.config.eos_token_id is None  # 50256 >= 64
    assert report.parameters == sum(p.numel() for p in model.parameters())
    units = sharding_units(model)
    assert units == list(model.transformer.h) and all(isinstance(u, GPT2Block) for u in units)


def test_classification_of_token_ids_builds_a_sequence_classifier() -> None:
    spec = DataSpec((CONTEXT,), "int64", "classification", 3, ())
    args = {"model_type": "bert", "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32}  # fmt: skip
    cfg = TrainConfig(model="hf", model_args=args)
    check_model(cfg, spec)
    model = build_model(cfg, spec)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model(torch.zeros((2, CONTEXT), dtype=torch.long)).logits.shape == (2, 3)


def test_fine_tuning_builds_the_saved_weights(gpt2_folder: Path) -> None:
    saved = AutoModelForCausalLM.from_pretrained(gpt2_folder)
    cfg = TrainConfig(model="transformers", model_args={"pretrained": str(gpt2_folder)})
    check_model(cfg, TOKENS)
    torch.manual_seed(5)  # a fresh build would draw other weights
    built = build_model(cfg, TOKENS)
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(built.state_dict()[key], value, rtol=0, atol=0)


def _bert_folder(tmp_path: Path) -> Path:
    config = AutoConfig.for_model(
        "bert", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=CONTEXT,
    )  # fmt: skip
    AutoModel.from_config(config).save_pretrained(tmp_path / "bert")
    return tmp_path / "bert"


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("missing", "train.model_args.pretrained='{tmp}/nowhere' is not a folder"),
        ("no config", "has no config.json"),
        ("other architecture", "holds a BertModel, but train.objective needs a BertLMHeadModel"),
        ("other model_type", "holds a gpt2 model, but train.model_args.model_type='llama'"),
        ("saved vocabulary", "pretrained's config has vocab_size=64 but the data's vocabulary"),
        (
            "given vocabulary",
            "train.model_args has vocab_size=100 but the data's vocabulary has 64",
        ),
        ("short context", "context of 8 positions but the data's samples are 16 tokens long"),
        ("unknown type", "model_type='gpt9' is not a transformers architecture"),
        ("nothing", "train.model=hf has no model to build"),
        ("images", "train.model=hf reads token ids"),
    ],
)
def test_each_mistake_is_one_line_naming_the_key_and_the_fix(
    tmp_path: Path, gpt2_folder: Path, case: str, said: str
) -> None:
    spec, args = TOKENS, dict[str, Any]()
    if case == "missing":
        args = {"pretrained": str(tmp_path / "nowhere")}
    elif case == "no config":
        (tmp_path / "empty").mkdir()
        args = {"pretrained": str(tmp_path / "empty")}
    elif case == "other architecture":
        args = {"pretrained": str(_bert_folder(tmp_path))}
    elif case == "other model_type":
        args = {"pretrained": str(gpt2_folder), "model_type": "llama"}
    elif case == "saved vocabulary":
        args = {"pretrained": str(gpt2_folder)}
        spec = DataSpec((CONTEXT,), "int64", "sequence", 80, (CONTEXT,))
    elif case == "given vocabulary":
        args = {**GPT2, "vocab_size": 100}
    elif case == "short context":
        args = {**GPT2, "n_positions": 8}
    elif case == "unknown type":
        args = {"model_type": "gpt9"}
    elif case == "images":
        args, spec = GPT2, DataSpec((1, 8, 8), "float32", "classification", 3, ())
    with pytest.raises(ConfigError) as err:
        check_model(TrainConfig(model="hf", model_args=args), spec)
    message = str(err.value)
    assert "\n" not in message and said.format(tmp=tmp_path) in message, message
    assert ": " in message.split(said.format(tmp=tmp_path))[-1]  # and the fix follows


def test_the_command_refuses_a_missing_folder_before_it_starts_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainflow.flows import cli

    monkeypatch.chdir(CHARLM)  # the example's text source imports from its folder
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # else no temporary server would start
    argv = ["run", "--preset", "tiny", "--set", f"workdir={tmp_path}",
            "--set", "preprocess.source=stdlib_text:StdlibText",
            "--set", 'preprocess.source_args={"max_files": 2, "context": 16}',
            "--set", "train.objective=sequence", "--set", "train.model=hf",
            "--set", f'train.model_args={{"pretrained": "{tmp_path}/nowhere"}}']  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pretrained=" in err and "is not a folder" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "datasets").exists()
    assert "prefect-temporary-server" not in {t.name for t in threading.enumerate()}


def test_without_transformers_the_error_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"  # import transformers: ImportError
        "from trainflow.tasks.spec import DataSpec\n"
        "from trainflow.tasks.train.config import TrainConfig\n"
        "from trainflow.tasks.train.model_plugins import check_model\n"
        "spec = DataSpec((8,), 'int64', 'sequence', 16, (8,))\n"
        "check_model(TrainConfig(model='hf', model_args={'model_type': 'gpt2'}), spec)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("trainflow.errors.ConfigError") and "pip install trainflow[hf]" in last


@pytest.mark.parametrize(
    ("model", "args", "objective", "name"),
    [
        ("hf", GPT2, "sequence", "gpt2-sequence"),
        ("mlp", {}, "regression", "mlp-regression"),
        ("reference_cnn", {}, "classification", "reference_cnn-classification"),
        ("char_transformer:build", {}, "sequence", "char_transformer-sequence"),
        ("acme.nets:wide", {}, "acme.objectives:Ranking", "nets-ranking"),
    ],
)
def test_the_registered_model_is_named_by_model_and_objective(
    model: str, args: dict[str, object], objective: str, name: str
) -> None:
    net: nn.Module = nn.Linear(2, 2)
    if model == "hf":
        net = build_model(TrainConfig(model=model, model_args=args), TOKENS)
    train = TrainConfig(model=model, model_args=args, objective=objective)
    assert default_name(train, net) == name
