"""The lazy backend registry: transports by name, imported only when used."""

from __future__ import annotations

import importlib
from typing import Any

from .base import Transport, TransportUnavailableError
from .emulated import EmulatedLink, parse_link_spec

_BUILTIN = {
    "local": "aaflow.cluster.transports.local:LocalTransport",
    "ray": "aaflow.cluster.transports.ray_store:RayStoreTransport",
    "nixl": "aaflow.cluster.transports.nixl:NixlTransport",
    "ucx": "aaflow.cluster.transports.ucx:UcxTransport",
}
_registry: dict[str, str] = dict(_BUILTIN)
PREFERRED = ("nixl", "ray", "ucx")  # between replicas, fastest measured here first (docs/RESULTS.md)


def register_transport(name: str, target: str) -> None:
    """Register a backend as `"package.module:ClassName"`; imported only when used."""
    if ":" not in target:
        raise ValueError(f"transport target must look like 'module.path:ClassName', got {target!r}")
    _registry[name] = target


def _load(name: str) -> type[Transport]:
    if name not in _registry:
        raise ValueError(f"unknown transport {name!r}; registered: {sorted(_registry)}")
    module_name, class_name = _registry[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"{_registry[name]} is not a Transport subclass")
    return cls


def get_transport(name: str, **kwargs: Any) -> Transport:
    """Create the transport registered as `name` (kwargs go to its constructor).

    A name with an `@` is an emulated link over a registered base, `"ray@10Gbps"` or
    `"nixl@1Gbps,50us"` (see `aaflow.cluster.transports.emulated`; kwargs go to the base).
    Raises ValueError for an unknown name or a bad link spec and TransportUnavailableError
    (a KVTransferError) naming the missing piece when the backend cannot run here.
    """
    if "@" in name:
        base, bytes_per_s, latency_s = parse_link_spec(name)
        return EmulatedLink(get_transport(base, **kwargs), bytes_per_s, latency_s, name=name)
    cls = _load(name)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise TransportUnavailableError(f"transport {name!r} is unavailable: {reason}")
    return cls(**kwargs)


def moves_in_place(name: str) -> bool:
    """Whether transport `name` reads and writes pool memory in place (`Transport.supports_segments`):
    a replica then moves KV with no staging copy. Emulated links (`"nixl@1Gbps"`) stage."""
    return "@" not in name and _load(name).supports_segments


def best_transport(allowed: tuple[str, ...] | None = None) -> str:
    """The first of PREFERRED that runs here (and is in `allowed`, when given): the default
    transport between replicas. Raises TransportUnavailableError when none is left."""
    ready = available_transports()
    for name in PREFERRED:
        if ready.get(name) is True and (allowed is None or name in allowed):
            return name
    raise TransportUnavailableError(f"no KV transport among {allowed or PREFERRED} runs here: "
                                    f"{ {n: ready.get(n) for n in PREFERRED} }")


def available_transports() -> dict[str, bool | str]:
    """Each registered transport mapped to True, or to the reason it cannot run here.

    Imports only aaflow's thin backend modules, never the heavy packages behind them.
    """
    result: dict[str, bool | str] = {}
    for name in sorted(_registry):
        try:
            reason = _load(name).unavailable_reason()
        except Exception as err:  # a broken third-party registration must not hide the others
            reason = f"cannot load {_registry[name]}: {err!r}"
        result[name] = True if reason is None else reason
    return result
