"""The operator functions of `import aaflow as af`: one name each, for local hosts and clusters.

`af.materialize(host_or_engine, text)` works in process (a `KVHost`, or an `Engine`, which gets a
host on first use); `af.materialize(cluster, "smollm2", text)` on a Ray cluster. The other
operators follow the ref they are given.
"""

from __future__ import annotations

from aaflow import operators
from aaflow.cluster import continuation
from aaflow.common.errors import InvalidArgumentError, KVLocationError
from aaflow.cluster import remote
from aaflow.cluster.cluster import Cluster
from aaflow.cluster.pins import pin_context
from aaflow.operators import KVHost


def _is_remote(kv) -> bool:
    return type(kv).__name__ == "RemoteKVRef"


def host_of(engine):
    """The `KVHost` of an in-process engine (made on first use)."""
    if not hasattr(engine, "kv_host"):
        engine.kv_host = KVHost(engine)
    return engine.kv_host


def materialize(target, *args, **kwargs):
    """Prefill a context and return its KVRef: `(cluster, model, text)` or `(host_or_engine, text)`."""
    if isinstance(target, Cluster):
        return remote.materialize(target, *args, **kwargs)

    if not isinstance(target, operators.KVHost) and not hasattr(target, "export_kv"):
        raise InvalidArgumentError(f"materialize needs a cluster, an Engine or a KVHost, got {type(target).__name__}")
    host = target if isinstance(target, operators.KVHost) else host_of(target)
    return operators.materialize(host, *args, **kwargs)


def _dispatch(name: str):
    def op(kv, *args, **kwargs):
        first = kv[0] if isinstance(kv, (list, tuple)) and kv else kv
        if _is_remote(first):
            return getattr(remote, name)(kv, *args, **kwargs)

        return getattr(operators, name)(kv, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = f"`{name}` on a local or a cluster KVRef (see operators.{name})."
    return op


def transfer(kv, destination, *args, **kwargs):
    """Copy kv's KV to `destination`: a replica handle (`aaflow.cluster.replicas(model)[i]`) for a cluster
    ref; a `KVHost` or an `Engine` for an in-process ref (see operators.transfer)."""
    if _is_remote(kv):
        return remote.transfer(kv, destination, *args, **kwargs)

    if not isinstance(destination, operators.KVHost):
        if not hasattr(destination, "export_kv"):
            raise KVLocationError(f"transfer needs a destination engine or KVHost for an in-process KVRef, "
                                  f"got {type(destination).__name__}")
        destination = host_of(destination)
    return operators.transfer(kv, destination, *args, **kwargs)


fork = _dispatch("fork")
evict = _dispatch("evict")
free = _dispatch("free")
_pin_ref = _dispatch("pin")


def pin(target, *args, **kwargs):
    """Keep KV resident under eviction pressure, for `ttl_s` seconds or until `af.unpin`.

    `pin(kv, ttl_s=None)` pins a KVRef (local or cluster); `pin(cluster, text, ttl_s=..., model=,
    system=)` pins a document on every replica of the model as the start of an agent prompt, so
    that workflows from any client reuse its KV until the pin expires (`aaflow.cluster.pins`); it
    returns the pinned refs."""
    if isinstance(target, Cluster):
        return pin_context(target, *args, **kwargs)
    return _pin_ref(target, *args, **kwargs)

unpin = _dispatch("unpin")


def generate(kv, *args, **kwargs):
    """Continue kv's context with a prompt and generate (see `aaflow.cluster.continuation.generate`)."""
    if _is_remote(kv):
        return remote.generate(kv, *args, **kwargs)

    return continuation.generate(kv, *args, **kwargs)


def compose(*kvs, **kwargs):
    """Compose local or cluster KVRefs (see operators.compose)."""
    if kvs and _is_remote(kvs[0]):
        return remote.compose(*kvs, **kwargs)

    return operators.compose(*kvs, **kwargs)
