"""The optimizer's settings and which parameters decay (tasks.train.optimizers).

Expected values come from the test: the exempt parameters are named by hand, and one AdamW
step on zero gradients must scale each decaying weight by exactly (1 - lr x weight_decay)
(decoupled decay; Adam's own update of a zero gradient is 0) and leave the exempt ones as
they were.
"""

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError
from trainflow.flows.config import build_config
from trainflow.flows.preflight import preflight, user_modules
from trainflow.tasks.plugins import PluginError
from trainflow.tasks.train.checkpointing.checkpoint import latest_checkpoint, load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.ref import CheckpointRef


class Net(nn.Module):
    """An embedding tied to the output layer, a norm, a conv with a batch norm, biases."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: the embedding's, exempt
        self.scale = nn.Parameter(torch.ones(()))


EXEMPT = {"embed.weight", "proj.bias", "norm.weight", "norm.bias", "bn.weight", "bn.bias", "scale"}
DECAY = {"proj.weight", "conv.weight"}


def _names(model: nn.Module, group: dict[str, object]) -> set[str]:
    ids = {id(p) for p in group["params"]}  # type: ignore[attr-defined]
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_biases_norms_and_embeddings_do_not_decay_by_default() -> None:
    model = Net()
    groups = make_optimizer(TrainConfig(weight_decay=0.1), model).param_groups
    assert [(_names(model, g), g["weight_decay"]) for g in groups] == [(DECAY, 0.1), (EXEMPT, 0.0)]
    everything = make_optimizer(TrainConfig(weight_decay=0.1, weight_decay_all=True), model)
    assert [_names(model, g) for g in everything.param_groups] == [DECAY | EXEMPT]
    assert everything.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize("decay_all", [False, True])
def test_one_adamw_step_on_zero_gradients_decays_exactly_the_decaying_weights(
    decay_all: bool,
) -> None:
    model = Net()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = TrainConfig(lr=0.1, weight_decay=0.5, weight_decay_all=decay_all)
    optimizer = make_optimizer(cfg, model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if decay_all or name in DECAY else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0)


def test_the_optimizers_own_settings_reach_torch() -> None:
    cfg = TrainConfig(adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    group = make_optimizer(cfg, Net()).param_groups[0]
    assert (group["betas"], group["eps"]) == ((0.8, 0.95), 1e-6)
    default = make_optimizer(TrainConfig(), Net()).param_groups[0]
    assert (default["betas"], default["eps"]) == ((0.9, 0.999), 1e-8)
    sgd = make_optimizer(TrainConfig(optimizer="sgd", momentum=0.5, nesterov=True), Net())
    assert isinstance(sgd, torch.optim.SGD)
    assert (sgd.param_groups[0]["momentum"], sgd.param_groups[0]["nesterov"]) == (0.5, True)
    plain = make_optimizer(TrainConfig(optimizer="sgd"), Net()).param_groups[0]
    assert (plain["momentum"], plain["nesterov"]) == (0.9, False)


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"optimizer": "sgd", "adam_beta2": 0.95}, "train.adam_beta2 is a setting of "),
        ({"momentum": 0.8}, "train.momentum is a setting of train.optimizer=sgd, not adamw"),
        ({"nesterov": True}, "train.nesterov is a setting of train.optimizer=sgd"),
        ({"optimizer": "sgd", "nesterov": True, "momentum": 0.0}, "nesterov=true needs momentum"),
    ],
)
def test_settings_of_the_other_optimizer_are_refused_at_construction(
    keys: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**keys)


def test_a_checkpoint_written_when_every_parameter_decayed_resumes_only_so(
    tmp_path: Path,
) -> None:
    """Such checkpoints recorded no train.weight_decay_all and hold one parameter group."""
    dataset = write_dataset(tmp_path / "ds")

    def job(cfg: TrainConfig) -> TrainingJob:
        return TrainingJob(TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path))

    saved = job(TrainConfig(weight_decay_all=True))._run_identity()
    del saved["weight_decay_all"]
    with pytest.raises(ConfigError, match=r"other settings \(weight_decay_all\)"):
        job(TrainConfig())._check_same_run(saved, tmp_path / "old.pt")
    job(TrainConfig(weight_decay_all=True))._check_same_run(saved, tmp_path / "old.pt")


LION = "tests.unit.lion_optimizer:Lion"


def test_a_plug_in_gets_the_groups_the_learning_rate_and_its_arguments() -> None:
    model = Net()
    cfg = TrainConfig(optimizer=LION, optimizer_args={"betas": [0.8, 0.9]}, weight_decay=0.1)
    optimizer = make_optimizer(cfg, model)
    assert type(optimizer).__name__ == "Lion"
    groups = optimizer.param_groups
    assert [(_names(model, g), g["weight_decay"]) for g in groups] == [(DECAY, 0.1), (EXEMPT, 0.0)]
    assert [(g["lr"], g["betas"]) for g in groups] == [(cfg.lr, (0.8, 0.9))] * 2


@pytest.mark.parametrize(
    "ref,args,message",
    [
        ("no_such_module:Lion", {}, r"^train.optimizer='no_such_module:Lion': no module named"),
        (
            "tests.unit.lion_optimizer:returns_a_number",
            {},
            r"lion_optimizer.py returned a float, not a torch.optim.Optimizer: return",
        ),
        (
            "tests.unit.lion_optimizer:raises",
            {},
            r"^the optimizer factory .* raised RuntimeError: no such optimizer at .*lion_optimizer",
        ),
        (LION, {"beta": 0.9}, r"raised TypeError: .*unexpected keyword argument 'beta'"),
    ],
)
def test_each_plug_in_mistake_is_one_line_before_any_work(
    tmp_path: Path, ref: str, args: dict[str, object], message: str
) -> None:
    overrides = {"workdir": str(tmp_path / "work"), "train.optimizer": ref}
    cfg = build_config("tiny", {**overrides, "train.optimizer_args": args})
    with pytest.raises(PluginError, match=message) as raised:
        preflight(cfg)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "work").exists()


def test_the_plug_ins_module_is_in_the_runs_code_snapshot(tmp_path: Path) -> None:
    cfg = build_config("tiny", {"workdir": str(tmp_path), "train.optimizer": LION})
    assert "tests.unit.lion_optimizer" in user_modules(cfg, preflight(cfg))
    assert user_modules(build_config("tiny"), preflight(build_config("tiny"))) == [
        "trainflow.tasks.train.models"
    ]


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"optimizer_args": {"lr_decay": 0.1}}, "train.optimizer_args is for a plug-in optimizer"),
        ({"optimizer": LION, "adam_beta1": 0.8}, r"a plug-in takes train.optimizer_args"),
    ],
)
def test_plug_in_and_built_in_settings_do_not_mix(keys: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**keys)


def test_a_job_trains_with_a_plug_in_and_checkpoints_its_state(tmp_path: Path) -> None:
    """One rank (submitit's debug executor): Lion's momentum is in the checkpoint."""
    dataset = write_dataset(tmp_path / "ds")
    cfg = TrainConfig(epochs=1, batch_size=32, device="cpu", optimizer=LION, lr=1e-4)
    spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run")
    executor = make_executor(ClusterConfig(executor="debug", ranks_per_node=1), tmp_path / "j")
    ref = wait_for_job(executor.submit(TrainingJob(spec)), lambda line: None)
    assert isinstance(ref, CheckpointRef)
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert path is not None
    state = load_state(path)["optimizer"]["state"]
    assert state and all(set(s) == {"exp_avg"} for s in state.values())
