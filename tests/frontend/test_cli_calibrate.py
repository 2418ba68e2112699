"""`aaflow calibrate` into an existing profile extends it: the models it does not measure keep their
entries (calibrating float32 must not drop the bfloat16 entries of the same machine's profile).
The calibration itself runs on a real cluster in tests/cluster/test_planning.py; here only what the
command hands it."""

from __future__ import annotations

import shutil

import aaflow as af
from aaflow import cli
from aaflow.costmodel.hardware import HardwareProfile, hardware_dir


class _NoCluster:
    def shutdown(self) -> None:
        pass


def test_calibrate_into_an_existing_profile_extends_it(tmp_path, monkeypatch):
    out = tmp_path / "machine.yaml"
    shutil.copy(hardware_dir() / "local-vm-amd-avx512bf16.yaml", out)
    handed = {}
    monkeypatch.setattr(af, "init", lambda **kwargs: _NoCluster())
    monkeypatch.setattr(af, "calibrate", lambda cluster, **kwargs: handed.update(kwargs))
    assert cli.main(["calibrate", "--dtype", "float32", "--out", str(out)]) == 0
    assert handed["base"] == HardwareProfile.load(out) and "smollm2|bfloat16|1t" in handed["base"].compute
    assert cli.main(["calibrate", "--out", str(tmp_path / "new.yaml")]) == 0
    assert handed["base"] is None  # nothing there yet: a profile of its own
