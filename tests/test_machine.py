"""The CPU kind that names this machine's hardware profile."""

from aaflow.calibration import default_profile_name
from aaflow.engine.dtypes import native_bf16
from aaflow.machine import cpu_kind, cpu_model
from costmodel.hardware import HardwareProfile, hardware_dir

KNOWN_ISAS = ("amx", "avx512bf16", "avx512", "avx2")


def test_cpu_kind_names_the_instructions_torch_uses():
    kind = cpu_kind()
    assert kind.endswith(("-amx", "-avx512bf16")) == native_bf16()
    assert isinstance(cpu_model(), str)


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
