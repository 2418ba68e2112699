"""Transports as test parameters: one that cannot run here is a recorded skip whose reason says what
is missing and how to install it, never a test case that silently vanishes."""

from __future__ import annotations

import pytest

from aaflow.cluster.transports import available_transports

REMOTE_TRANSPORTS = ("ray", "nixl", "ucx")  # every backend that moves KV between processes


def unavailable(name: str) -> str | None:
    """Why transport `name` cannot run here (with its install command), or None."""
    status = available_transports().get(name, f"transport {name!r} is not registered")
    return None if status is True else f"transport {name!r} unavailable: {status}"


def skip_unless(name: str):
    """A mark that skips a test, with the reason, when transport `name` cannot run here."""
    reason = unavailable(name)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def transport_params(names=REMOTE_TRANSPORTS) -> list:
    """`pytest.param` per transport, each skipped with its reason where it cannot run here."""
    return [pytest.param(name, id=name, marks=skip_unless(name)) for name in names]
