"""The allocator tuning of allocator.py: on by default on glibc, off on request."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = "from aaflow.engine.allocator import keep_freed_memory; print(keep_freed_memory())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("setting,expected", [(None, "True"), ("0", "False")])
def test_malloc_tuning_is_on_by_default_and_can_be_turned_off(setting, expected, monkeypatch):
    if setting is None:
        monkeypatch.delenv("AAFLOW_MALLOC_TUNING", raising=False)
    else:
        monkeypatch.setenv("AAFLOW_MALLOC_TUNING", setting)
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
