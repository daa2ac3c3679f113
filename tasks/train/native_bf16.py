"""Whether a device computes bf16 natively, read from the hardware itself, and why.

precision=auto must pick what is fastest where the rank runs. On a CPU, bf16 autocast pays off
only where the cores have bf16 instructions (x86: avx512_bf16, or AMX's amx_bf16; Arm: the
bf16 feature): elsewhere oneDNN emulates it, and
oneDNN's own check (trainflow.compat.mkldnn_bf16_supported) still answers True on any AVX-512 core
(measured on an Intel Xeon with avx512f and avx512_vnni but neither avx512_bf16 nor AMX: the
demo trained 1.5x slower in bf16 than in fp32). So the CPU's own flags decide, from
/proc/cpuinfo: free, the same answer on every rank and every restart, unlike a timing taken at
rank start on a shared, busy node. On a GPU, bf16 is native from compute capability 8.0
(Ampere); ``torch.cuda.is_bf16_supported()`` counts emulation too (its default since 2.3).
"""

from dataclasses import dataclass
from pathlib import Path

import torch

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags of native bf16 compute: x86 AVX512-BF16, x86 AMX-BF16, Arm's BF16."""
CUDA_BF16_CAPABILITY = (8, 0)
"""The first compute capability with bf16 tensor cores (Ampere)."""


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says of the first CPU."""

    model: str
    """Its model name ('AMD EPYC 9254 24-Core Processor'), or the architecture when unnamed."""
    flags: frozenset[str]
    """Its feature flags (x86 'flags', Arm 'Features')."""


def parse_cpuinfo(text: str) -> CpuInfo:
    """The model name and flags of the first processor in a /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if sep and key not in fields:
            fields[key] = value.strip()
    flags = fields.get("flags") or fields.get("features") or ""
    model = fields.get("model name") or fields.get("cpu model") or "unnamed CPU"
    return CpuInfo(model, frozenset(flags.split()))


def this_cpu() -> CpuInfo:
    """This machine's CPU (an unnamed CPU without flags where /proc/cpuinfo is unreadable)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuInfo("unnamed CPU", frozenset())


def cpu_bf16(cpu: CpuInfo) -> tuple[bool, str]:
    """(native, why): whether `cpu` computes bf16 natively, in words naming the CPU."""
    found = [flag for flag in CPU_BF16_FLAGS if flag in cpu.flags]
    if found:
        return True, f"{cpu.model} computes bf16 natively ({', '.join(found)})"
    return False, (
        f"{cpu.model} has no native bf16 (no {', '.join(CPU_BF16_FLAGS[:2])} flag): bf16 "
        "autocast would be emulated, slower than fp32"
    )


def cuda_bf16(name: str, capability: tuple[int, int]) -> tuple[bool, str]:
    """(native, why) for a GPU of this name and compute capability."""
    cc = f"{name} (compute capability {capability[0]}.{capability[1]})"
    if tuple(capability) >= CUDA_BF16_CAPABILITY:
        return True, f"{cc} computes bf16 natively"
    return False, f"{cc} has no native bf16 (it needs 8.0)"


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """(native, why) for the device a rank computes on."""
    if device.type == "cuda":
        if torch.version.hip:  # ROCm reports no CUDA capability: ask without emulation
            name = torch.cuda.get_device_name(device)
            native = bool(torch.cuda.is_bf16_supported(including_emulation=False))
            return native, f"{name} {'computes' if native else 'lacks'} bf16 natively"
        capability = torch.cuda.get_device_capability(device)
        return cuda_bf16(torch.cuda.get_device_name(device), capability)
    if device.type == "cpu":
        return cpu_bf16(this_cpu())
    return False, f"{device.type} devices are not known to compute bf16 natively"
