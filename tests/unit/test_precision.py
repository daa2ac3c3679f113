"""The precision policy: what auto picks, what is refused, what autocast and the scaler do."""

import pytest
import torch

import trainflow.tasks.train.precision as precision
from trainflow.tasks.errors import ConfigError
from trainflow.tasks.train.precision import PrecisionPolicy, resolve_precision

CPU = torch.device("cpu")
needs_cpu_bf16 = pytest.mark.skipif(
    not precision.cpu_supports_bf16(), reason="this CPU has no native bf16"
)


def _linear_output_dtype(policy: PrecisionPolicy) -> torch.dtype:
    layer = torch.nn.Linear(4, 4)
    with policy.autocast():
        return layer(torch.randn(2, 4)).dtype


def test_fp32_runs_without_autocast_or_scaling() -> None:
    policy = resolve_precision("fp32", CPU)
    assert (policy.dtype, policy.use_scaler, policy.name) == (None, False, "fp32")
    assert _linear_output_dtype(policy) == torch.float32
    assert not policy.make_scaler().is_enabled()


@needs_cpu_bf16
def test_bf16_on_a_cpu_with_bf16_autocasts_without_scaling() -> None:
    policy = resolve_precision("bf16", CPU)
    assert policy.name == "bf16" and not policy.use_scaler
    assert _linear_output_dtype(policy) == torch.bfloat16
    assert not policy.make_scaler().is_enabled()


def test_auto_on_cpu_is_bf16_exactly_when_the_cpu_has_it() -> None:
    expected = "bf16" if precision.cpu_supports_bf16() else "fp32"
    assert resolve_precision("auto", CPU).name == expected


def test_auto_on_a_cpu_without_bf16_falls_back_to_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: False)
    assert resolve_precision("auto", CPU).name == "fp32"


def test_bf16_where_unsupported_is_a_config_error_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: False)
    with pytest.raises(ConfigError, match="precision=auto"):
        resolve_precision("bf16", CPU)


def test_fp16_on_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="fp16 is for GPUs"):
        resolve_precision("fp16", CPU)


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown precision"):
        resolve_precision("int8", CPU)


def test_the_fp16_policy_scales_losses() -> None:
    policy = PrecisionPolicy("cpu", torch.float16, use_scaler=True, name="fp16")
    assert policy.make_scaler().is_enabled()
