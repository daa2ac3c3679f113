"""Mixed-precision policy: which autocast dtype, and whether fp16 loss scaling is needed.

One code path on CPU and GPU: the loop always enters ``policy.autocast()`` and always steps
through a GradScaler, which is a no-op unless the policy is fp16.
"""

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from trainflow.compat import mkldnn_bf16_supported
from trainflow.errors import ConfigError
from trainflow.tasks.train.native_bf16 import native_bf16, this_cpu


@dataclass(frozen=True)
class PrecisionPolicy:
    """The resolved precision of a run on one device."""

    device_type: str
    """'cpu' or 'cuda': the autocast device type."""
    dtype: torch.dtype | None
    """Autocast dtype; None runs in fp32 without autocast."""
    use_scaler: bool
    """True only for fp16, whose small range needs loss scaling."""
    name: str
    """'bf16', 'fp16' or 'fp32', for logs and metrics."""
    reason: str = ""
    """Why this precision: 'auto: AMD EPYC ... computes bf16 natively (avx512_bf16)'."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """torch.autocast for the policy's dtype, or a context that does nothing for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def make_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler that scales only under fp16 (disabled scalers pass through)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.use_scaler)


def cpu_supports_bf16() -> bool:
    """True when oneDNN runs bf16 on this CPU at all: natively, or emulated on AVX-512 cores
    (tasks.train.native_bf16 tells which)."""
    return mkldnn_bf16_supported()


def device_supports_bf16(device: torch.device) -> bool:
    """True when bf16 autocast runs on `device` at all (perhaps emulated, slowly)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return device.type == "cpu" and (cpu_supports_bf16() or native_bf16(device)[0])


def _policy(device: torch.device, name: str, reason: str) -> PrecisionPolicy:
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
    return PrecisionPolicy(device.type, dtypes[name], name == "fp16", name, reason)


def auto_precision(device: torch.device) -> PrecisionPolicy:
    """What precision=auto picks on `device`: bf16 where it computes bf16 natively, else fp16
    with loss scaling on a GPU, else fp32; the reason names the device and what decided."""
    native, why = native_bf16(device)
    if native:
        return _policy(device, "bf16", f"auto: {why}")
    if device.type == "cuda":
        return _policy(device, "fp16", f"auto: {why}: fp16 with loss scaling")
    return _policy(device, "fp32", f"auto: {why}")


def resolve_precision(requested: str, device: torch.device) -> PrecisionPolicy:
    """The policy for `requested` ('auto', 'bf16', 'fp16' or 'fp32') on `device`.

    auto: see auto_precision. bf16 is refused where the device cannot run it at all, and runs
    (saying it will be slow) where it is emulated. fp16 on CPU is refused: CPUs without
    AMX-FP16 emulate it (slower than fp32) and it would still need loss scaling, so bf16 or
    fp32 is always the better choice there.
    """
    if requested == "auto":
        return auto_precision(device)
    if requested == "bf16" and not device_supports_bf16(device):
        raise ConfigError(
            f"precision=bf16 but {_describe(device)} has no native bf16 support: "
            "set train.precision=auto (picks the best supported) or fp32"
        )
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError(
            f"precision=fp16 is for GPUs; {_describe(device)} would emulate it slowly: "
            "set train.precision=auto, bf16 or fp32"
        )
    if requested not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"unknown precision {requested!r}: use auto, bf16, fp16 or fp32")
    reason = "set by train.precision"
    if requested == "bf16" and not native_bf16(device)[0]:
        reason += f" ({native_bf16(device)[1]})"
    return _policy(device, requested, reason)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"
    return f"this CPU ({this_cpu().model})"
