"""The precision policy: what auto picks, what is refused, what autocast and the scaler do."""

import re
from pathlib import Path

import pytest
import torch

import trainflow.tasks.train.native_bf16 as native_bf16
import trainflow.tasks.train.precision as precision
from trainflow.errors import ConfigError
from trainflow.tasks.train.native_bf16 import cpu_bf16, cuda_bf16, parse_cpuinfo
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


# Real flag lines. An AMD EPYC (Zen 4) with avx512_bf16, as lscpu printed it:
EPYC_ZEN4 = """Model name: AMD EPYC 9254 24-Core Processor
Flags: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good amd_lbr_v2 nopl nonstop_tsc cpuid extd_apicid aperfmperf rapl pni pclmulqdq monitor ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext perfctr_core perfctr_nb bpext perfctr_llc mwaitx cpb cat_l3 cdp_l3 hw_pstate ssbd mba perfmon_v2 ibrs ibpb stibp ibrs_enhanced vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local avx512_bf16 clzero irperf xsaveerptr rdpru wbnoinvd cppc arat npt lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid decodeassists pausefilter pfthreshold avic v_vmsave_vmload vgif x2avic v_spec_ctrl vnmi avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid overflow_recov succor smca fsrm flush_l1d
"""  # noqa: E501
# An Intel Xeon (Cascade Lake) with avx512f and avx512_vnni, neither avx512_bf16 nor AMX: where
# oneDNN answers True and emulates bf16 (/proc/cpuinfo, first processor):
XEON_CLX = """processor       : 0
vendor_id       : GenuineIntel
cpu family      : 6
model           : 85
model name      : Intel(R) Xeon(R) Gold 6226R CPU @ 2.90GHz
stepping        : 7
flags           : fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss syscall nx pdpe1gb rdtscp lm constant_tsc arch_perfmon nopl xtopology tsc_reliable nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 invpcid avx512f avx512dq rdseed adx smap clflushopt clwb avx512cd avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves arat pku ospke avx512_vnni md_clear flush_l1d arch_capabilities
bugs            : spectre_v1 spectre_v2 spec_store_bypass swapgs

processor       : 1
model name      : Intel(R) Xeon(R) Gold 6226R CPU @ 2.90GHz
"""  # noqa: E501
# The machine these tests were written on: an AMD EPYC (Zen 1) under KVM, AVX2, no AVX-512.
EPYC_ZEN1 = """model name\t: AMD EPYC Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext ssbd ibpb vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 rdseed adx smap clflushopt sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr virt_ssbd arat
"""  # noqa: E501


@pytest.mark.parametrize(
    ("cpuinfo", "native", "model", "why"),
    [
        (EPYC_ZEN4, True, "AMD EPYC 9254 24-Core Processor", "natively (avx512_bf16)"),
        (XEON_CLX, False, "Intel(R) Xeon(R) Gold 6226R CPU @ 2.90GHz", "would be emulated"),
        (EPYC_ZEN1, False, "AMD EPYC Processor", "no native bf16"),
        (EPYC_ZEN1.replace(" arat", " arat amx_bf16 amx_tile"), True, "AMD EPYC", "(amx_bf16)"),
        ("Features\t: fp asimd evtstrm aes pmull sha1 sha2 bf16 i8mm sve\n", True, "", "bf16"),
    ],
)
def test_native_bf16_is_read_from_the_cpus_own_flags(
    cpuinfo: str, native: bool, model: str, why: str
) -> None:
    cpu = parse_cpuinfo(cpuinfo)
    assert cpu.model.startswith(model)
    got, reason = cpu_bf16(cpu)
    assert got is native and reason.startswith(cpu.model) and why in reason


@pytest.mark.parametrize(("cpuinfo", "expected"), [(EPYC_ZEN4, "bf16"), (XEON_CLX, "fp32")])
def test_auto_on_a_cpu_picks_bf16_only_where_it_is_native(
    monkeypatch: pytest.MonkeyPatch, cpuinfo: str, expected: str
) -> None:
    monkeypatch.setattr(native_bf16, "this_cpu", lambda: parse_cpuinfo(cpuinfo))
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: True)  # oneDNN says yes to both
    policy = resolve_precision("auto", CPU)
    assert policy.name == expected and policy.reason.startswith("auto: ")
    assert parse_cpuinfo(cpuinfo).model in policy.reason


def _this_cpu_has_native_bf16_flags() -> bool:
    """Read /proc/cpuinfo here, apart from the code under test: the first processor's x86
    'flags' or Arm 'Features' line names avx512_bf16, amx_bf16 or (Arm) bf16."""
    text = Path("/proc/cpuinfo").read_text()
    line = re.search(r"^(flags|Features)\s*:(.*)$", text, re.MULTILINE)
    assert line, "no flags line in /proc/cpuinfo"
    flags = set(line.group(2).split())
    wanted = {"bf16"} if line.group(1) == "Features" else {"avx512_bf16", "amx_bf16"}
    return bool(flags & wanted)


def test_auto_on_this_cpu_follows_its_flags() -> None:
    expected = "bf16" if _this_cpu_has_native_bf16_flags() else "fp32"
    policy = resolve_precision("auto", CPU)
    assert policy.name == expected, policy.reason
    assert policy.reason.startswith("auto: ") and ("natively" in policy.reason) == (
        expected == "bf16"
    )


# What auto must pick on each GPU, written out by hand: bf16 from Ampere (8.0), else fp16.
GPUS = [
    ("Tesla V100-SXM2-32GB", (7, 0), "fp16"),
    ("Tesla T4", (7, 5), "fp16"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16"),
    ("NVIDIA GeForce RTX 4090", (8, 9), "bf16"),
    ("NVIDIA H100 80GB HBM3", (9, 0), "bf16"),
]


@pytest.mark.parametrize(("name", "capability", "expected"), GPUS)
def test_auto_on_a_gpu_picks_the_policy_of_its_generation(
    monkeypatch: pytest.MonkeyPatch, name: str, capability: tuple[int, int], expected: str
) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    policy = resolve_precision("auto", torch.device("cuda", 0))
    assert policy.name == expected and policy.use_scaler is (expected == "fp16")
    assert policy.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[expected]
    assert name in policy.reason


@pytest.mark.parametrize(
    ("capability", "native"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)]
)
def test_a_gpu_has_native_bf16_from_ampere(capability: tuple[int, int], native: bool) -> None:
    got, reason = cuda_bf16("GPU", capability)
    assert got is native and f"compute capability {capability[0]}.{capability[1]}" in reason


def test_forced_bf16_on_an_emulating_cpu_runs_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_bf16, "this_cpu", lambda: parse_cpuinfo(XEON_CLX))
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: True)
    policy = resolve_precision("bf16", CPU)
    assert policy.name == "bf16" and "would be emulated, slower than fp32" in policy.reason


def test_bf16_where_unsupported_is_a_config_error_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(native_bf16, "this_cpu", lambda: parse_cpuinfo(EPYC_ZEN1))
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
