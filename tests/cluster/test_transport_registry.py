"""The transport registry and the in-process `local` transport, with no peers and no Ray: every
backend is reported, an unknown name is a value error, uninstalled or broken backends are reported
rather than raised; a local handle is refused in another process, and expose refuses what no
transport can move. The suite over every backend between two processes: test_transports.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aaflow.common.errors import KVTransferError
from aaflow.cluster.transports import (
    Transport,
    TransportUnavailableError,
    available_transports,
    get_transport,
    register_transport,
)
from aaflow.cluster.transports import registry as transport_registry
from tests.cluster.transport_peers import BACKENDS, TINY, make_kv


# -- registry ----------------------------------------------------------------------------------


def test_available_transports_reports_each_backend():
    report = available_transports()
    assert set(BACKENDS) <= set(report)
    assert report["local"] is True
    for name, status in report.items():
        assert status is True or (isinstance(status, str) and status), (name, status)


def test_unknown_transport_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        get_transport("carrier-pigeon")


class _NeverInstalled(Transport):
    name = "never"

    @classmethod
    def unavailable_reason(cls):
        return "package providing 'never_installed' is not installed"

    def expose(self, tensor):
        raise AssertionError("unreachable")

    def _fetch(self, handle, out, deadline):
        raise AssertionError("unreachable")

    def release(self, handle):
        pass

    def close(self):
        pass


def test_uninstalled_and_broken_backends_are_reported_not_raised(monkeypatch):
    monkeypatch.setattr(transport_registry, "_registry", dict(transport_registry._registry))
    register_transport("never", f"{__name__}:_NeverInstalled")
    register_transport("broken", "no_such_module_aaflow:Nothing")
    report = available_transports()
    assert "never_installed" in report["never"]
    assert "no_such_module_aaflow" in report["broken"]
    with pytest.raises(TransportUnavailableError, match="never_installed"):
        get_transport("never")


# -- in process, no peers --------------------------------------------------------------------


def test_local_handle_is_refused_in_another_process():
    transport = get_transport("local")
    tensor = make_kv(TINY, "float32", 0)
    handle = dataclasses.replace(transport.expose(tensor), pid=-1)
    with pytest.raises(KVTransferError, match="only works inside one process"):
        transport.fetch(handle, torch.empty_like(tensor))
    transport.close()


def test_expose_rejects_what_it_cannot_move():
    transport = get_transport("local")
    with pytest.raises(ValueError, match="contiguous"):
        transport.expose(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="empty"):
        transport.expose(torch.zeros(0))
    with pytest.raises(ValueError, match="timeout_s"):
        transport.fetch(transport.expose(torch.zeros(2)), torch.zeros(2), timeout_s=0)
    transport.close()
