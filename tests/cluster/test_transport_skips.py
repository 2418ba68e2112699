"""A transport that is not installed is a recorded skip naming its install command, never a test
case that silently vanishes (part of the shared transport suites' contract)."""

from __future__ import annotations

import importlib.util

import pytest

from aaflow.cluster.transports import registry
from tests.cluster import transport_params


@pytest.mark.parametrize("name", transport_params.REMOTE_TRANSPORTS)
def test_a_missing_package_is_reported_with_its_install_command(monkeypatch, name):
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *args: None)  # nothing is installed
    reason = registry._load(name).unavailable_reason()
    assert reason and "not installed" in reason and "pip install" in reason, (name, reason)


def test_every_remote_transport_stays_a_parameter_and_skips_with_the_reason(monkeypatch):
    report = {"local": True, "ray": True, "nixl": "package providing 'nixl' is not installed; pip install nixl==1.5.1",
              "ucx": True}
    monkeypatch.setattr(transport_params, "available_transports", lambda: report)
    params = {p.id: p for p in transport_params.transport_params()}
    assert set(params) == {"ray", "nixl", "ucx"}, "a transport that cannot run must still be a (skipped) case"
    (mark,) = params["nixl"].marks
    assert mark.args == (True,) and "pip install nixl==1.5.1" in mark.kwargs["reason"]
    assert all(m.args == (False,) for name in ("ray", "ucx") for m in params[name].marks)
