"""Config: presets, overrides, validation messages that name the field and the fix."""

import pytest

from trainflow.errors import ConfigError
from trainflow.flows.config import (
    GPU_BATCH,
    PRESETS,
    PipelineConfig,
    build_config,
    build_sweep,
    config_hash,
    expand_grid,
    flatten,
    parse_override,
    scaled_lr,
)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_validates(preset: str) -> None:
    cfg = build_config(preset)
    assert isinstance(cfg, PipelineConfig)
    assert cfg.name == preset


def test_demo_preset_is_mnist_on_two_cpu_ranks() -> None:
    cfg = build_config("demo")
    assert cfg.preprocess.source == "mnist"
    assert cfg.cluster.ranks_per_node == 2
    assert cfg.cluster.executor == "local"


def test_gpu_preset_is_one_gpu_rank_with_a_scaled_learning_rate() -> None:
    cfg, demo = build_config("gpu"), build_config("demo")
    assert (cfg.cluster.ranks_per_node, cfg.cluster.gpus_per_node) == (1, 1)
    assert cfg.preprocess == demo.preprocess
    assert cfg.train.batch_size == GPU_BATCH > demo.train.batch_size
    ratio = (cfg.train.batch_size / demo.train.batch_size) ** 0.5
    assert cfg.train.lr == pytest.approx(demo.train.lr * ratio)
    assert not cfg.train.cuda_graphs and cfg.train.precision == "auto"
    assert scaled_lr(64) == pytest.approx(5e-3) and scaled_lr(256) == pytest.approx(1e-2)


def test_overrides_parse_json_values_and_text() -> None:
    cfg = build_config(
        "tiny", ["train.epochs=5", "train.lr=0.01", "name=x", "preprocess.synthetic_shape=[3,8,8]"]
    )
    assert cfg.train.epochs == 5
    assert cfg.train.lr == 0.01
    assert cfg.name == "x"
    assert cfg.preprocess.synthetic_shape == (3, 8, 8)


def test_mapping_overrides_as_from_prefect_parameters() -> None:
    cfg = build_config("tiny", {"train.epochs": 3, "cluster.ranks_per_node": 1})
    assert cfg.train.epochs == 3
    assert cfg.cluster.ranks_per_node == 1


def test_bad_choice_names_field_and_allowed_values() -> None:
    with pytest.raises(ConfigError) as err:
        build_config("demo", ["train.precision=fp8"])
    msg = str(err.value)
    assert "train.precision" in msg
    assert "'bf16'" in msg and "'fp16'" in msg and "'fp32'" in msg
    assert "fp8" in msg


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"train\.epoch: unknown key.*train\.epochs"):
        build_config("demo", ["train.epoch=3"])


def test_out_of_range_value_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train\.epochs"):
        build_config("demo", ["train.epochs=0"])


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(ConfigError, match="choose one of: demo, tiny"):
        build_config("nope")


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match=r"dotted\.key=value"):
        parse_override("train.epochs")


def test_override_through_a_leaf_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a section"):
        build_config("demo", ["name.x=1"])


def test_folder_source_needs_existing_path(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match="needs a path"):
        build_config("demo", ["preprocess.source=folder"])
    with pytest.raises(ConfigError, match="does not exist"):
        build_config("demo", ["preprocess.source=npz", "preprocess.path=/no/such/file.npz"])


def test_gpus_must_match_ranks() -> None:
    with pytest.raises(ConfigError, match="gpus_per_node"):
        build_config("demo", ["cluster.gpus_per_node=1"])


def test_debug_executor_needs_one_rank() -> None:
    with pytest.raises(ConfigError, match="ranks_per_node=1"):
        build_config("demo", ["cluster.executor=debug"])
    assert build_config("demo", ["cluster.executor=debug", "cluster.ranks_per_node=1"])


def test_several_errors_are_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        build_config("demo", ["train.lr=-1", "evaluate.batch_size=0"])
    assert "train.lr" in str(err.value) and "evaluate.batch_size" in str(err.value)


def test_config_is_frozen() -> None:
    cfg = build_config("demo")
    with pytest.raises(ValueError):
        cfg.train.epochs = 3  # type: ignore[misc]


def test_flatten_gives_dotted_string_params() -> None:
    flat = flatten(build_config("tiny"))
    assert flat["train.epochs"] == "2"
    assert flat["preprocess.synthetic_shape"] == "[1, 16, 16]"
    assert flat["cluster.dask.n_workers"] == "2"
    assert all(isinstance(v, str) for v in flat.values())


def test_grid_expands_to_the_product() -> None:
    elements = expand_grid({"train.lr": [0.1, 0.2], "train.batch_size": [8, 16, 32]})
    assert len(elements) == 6
    assert elements[0] == {"train.lr": 0.1, "train.batch_size": 8}


def test_grid_rejects_non_train_keys_and_empty_values() -> None:
    with pytest.raises(ConfigError, match="only train"):
        expand_grid({"preprocess.seed": [1, 2]})
    with pytest.raises(ConfigError, match="non-empty list"):
        expand_grid({"train.lr": []})
    with pytest.raises(ConfigError, match="needs a grid"):
        expand_grid({})


def test_every_sweep_element_is_validated_up_front() -> None:
    with pytest.raises(ConfigError, match=r"sweep element 1 .*train\.lr"):
        build_sweep("tiny", [], {"train.lr": [0.1, -1.0]})
    base, elements = build_sweep("tiny", ["train.epochs=3"], {"train.lr": [0.1, 0.2]})
    assert base.train.epochs == 3
    assert [cfg.train.lr for _, cfg in elements] == [0.1, 0.2]
    assert all(cfg.train.epochs == 3 for _, cfg in elements)


def test_config_hash_is_stable_and_tracks_the_training_recipe() -> None:
    base = config_hash(build_config("tiny"))
    assert len(base) == 64
    assert config_hash(build_config("tiny")) == base
    # A different recipe is a different hash.
    assert config_hash(build_config("tiny", ["train.lr=0.001"])) != base
    assert config_hash(build_config("tiny", ["preprocess.seed=1"])) != base
    assert config_hash(build_config("tiny", ["cluster.ranks_per_node=1"])) != base  # global batch


def test_config_hash_ignores_what_does_not_change_the_model(tmp_path: object) -> None:
    base = config_hash(build_config("tiny"))
    same = [
        f"workdir={tmp_path}",
        "name=other",
        "tracking.experiment=elsewhere",
        "evaluate.batch_size=7",
        "evaluate.registered_model=other-model",
        "train.log_every_epochs=2",
        "cluster.timeout_min=5",
        "cluster.cpus_per_task=2",
        "cluster.dask.n_workers=1",
    ]
    assert config_hash(build_config("tiny", same)) == base


def test_registered_model_and_alias_names_are_checked() -> None:
    cfg = build_config("tiny", ["evaluate.registered_model=team.cnn-v2_b"])
    assert cfg.evaluate.registered_model == "team.cnn-v2_b"
    assert (
        build_config("tiny", ["evaluate.registered_model=null"]).evaluate.registered_model is None
    )
    with pytest.raises(ConfigError, match=r"evaluate\.registered_model.*letters, digits"):
        build_config("tiny", ["evaluate.registered_model=my/model"])
    with pytest.raises(ConfigError, match=r"evaluate\.champion_alias.*letters, digits"):
        build_config("tiny", ["evaluate.champion_alias=best model"])
    for reserved in ("latest", "v3"):
        with pytest.raises(ConfigError, match="reserved by MLflow"):
            build_config("tiny", [f"evaluate.champion_alias={reserved}"])


def test_registration_needs_a_logged_model() -> None:
    # log_model off with the default name: registration is simply skipped.
    cfg = build_config("demo", ["evaluate.log_model=false"])
    assert cfg.evaluate.registered_model == "auto"
    # Asking for both explicitly is a contradiction the user must resolve.
    with pytest.raises(ConfigError, match=r"needs log_model=true.*registered_model=false"):
        build_config("demo", ["evaluate.log_model=false", "evaluate.registered_model=m"])
