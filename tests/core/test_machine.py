"""The CPU kind that names this machine's hardware profile."""

import platform

from aaflow.engine.dtypes import native_bf16
from aaflow.common.machine import cpu_kind, cpu_model
from aaflow.costmodel.hardware import HardwareProfile, hardware_dir
from aaflow.costmodel.profile_store import default_profile_name

KNOWN_ISAS = ("amx", "avx512bf16", "avx512", "avx2")


def test_cpu_kind_names_the_instructions_torch_uses():
    kind = cpu_kind()
    assert kind.endswith(("-amx", "-avx512bf16")) == native_bf16()
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
    for line in open("/proc/cpuinfo"):
        if line.startswith("vendor_id") and line.split(":", 1)[1].strip() in vendor:
            assert kind.split("-")[0] == vendor[line.split(":", 1)[1].strip()]
            break


def test_cpu_model_is_the_name_the_os_reports():
    names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    assert cpu_model() == (names[0] if names else platform.processor())


def test_the_default_profile_is_named_for_host_and_cpu_kind():
    name = default_profile_name()
    assert name.startswith("local-") and name.endswith(cpu_kind())


def test_shipped_local_profiles_are_measured_and_named_for_a_cpu_kind():
    paths = sorted(hardware_dir().glob("local-*.yaml"))
    assert paths
    for path in paths:
        profile = HardwareProfile.load(path)
        assert profile.name == path.stem and profile.measured
        assert path.stem.rsplit("-", 1)[-1] in KNOWN_ISAS, path.name
        assert profile.compute and profile.links
