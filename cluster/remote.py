"""The five operators on a cluster: `RemoteKVRef` handles and the functions `af.*` dispatch to.

A `RemoteKVRef` names KV living in a replica actor; KV bytes only move through transports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from aaflow.errors import AAFlowError, KVLocationError, ModelMismatchError
from cluster.cluster import Cluster, ReplicaHandle
from cluster.replica import RefRecord

PREFERRED_TRANSPORTS = ("nixl", "ray", "ucx")  # fastest measured here first (see docs/RESULTS.md)


@dataclass(frozen=True, eq=False)
class RemoteKVRef:
    """A KVRef living on a replica of a cluster (`replica` is its `ReplicaHandle`)."""

    record: RefRecord
    replica: ReplicaHandle

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.record.token_ids

    @property
    def fingerprint(self) -> str:
        return self.record.fingerprint

    @property
    def nbytes(self) -> int:
        return self.record.nbytes

    @property
    def exact(self) -> bool:
        return self.record.exact

    @property
    def fidelity(self):
        return self.record.fidelity

    def __len__(self) -> int:
        return len(self.record.token_ids)


def _get(ref):
    """The result of a replica call; an aaflow error raised in the replica comes back as itself,
    not wrapped in Ray's `RayTaskError` (whose traceback names Ray internals)."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, AAFlowError):
            raise err.cause from None
        raise


def best_transport() -> str:
    from cluster.transports import available_transports

    ok = {name for name, status in available_transports().items() if status is True}
    return next(t for t in PREFERRED_TRANSPORTS if t in ok)


def materialize(cluster: Cluster, model: str, text_or_ids: str | Sequence[int], *, replica: ReplicaHandle | None = None,
                lineage: bool = True) -> RemoteKVRef:
    """Prefill a context on a replica of `model` (the given one, or the first) and return its handle."""
    candidates = cluster.replicas(model)
    if not candidates:
        raise ModelMismatchError(f"the cluster serves no replica of {model!r} (serves {sorted(cluster.models)})")
    target = replica or candidates[0]
    return RemoteKVRef(_get(target.actor.materialize.remote(text_or_ids, lineage)), target)


def transfer(kv: RemoteKVRef, destination: ReplicaHandle, transport: str | None = None) -> RemoteKVRef:
    """An exact copy of kv's blocks on `destination` (a fork when it is already there)."""
    if destination.name == kv.replica.name:
        return fork(kv, 1)[0]
    transport = transport or best_transport()
    handle, shape, record = _get(kv.replica.actor.expose.remote(kv.id, transport))
    try:
        received, _ = _get(destination.actor.receive.remote(handle, shape, record, transport))
    finally:
        _get(kv.replica.actor.release.remote(handle, transport))
    return RemoteKVRef(received, destination)


def fork(kv: RemoteKVRef, n: int = 2) -> list[RemoteKVRef]:
    return [RemoteKVRef(r, kv.replica) for r in _get(kv.replica.actor.fork.remote(kv.id, n))]


def compose(*kvs: RemoteKVRef, mode: str = "exact", r: float = 0.15) -> RemoteKVRef:
    home = kvs[0].replica
    for kv in kvs[1:]:
        if kv.replica.name != home.name:
            raise KVLocationError(f"cannot compose {kvs[0].id} on {home.name} with {kv.id} on {kv.replica.name}: "
                                  "transfer one of them first (af.transfer(kv, replica))")
    return RemoteKVRef(_get(home.actor.compose.remote([k.id for k in kvs], mode, r)), home)


def evict(kv: RemoteKVRef, spill: bool | None = None) -> None:
    _get(kv.replica.actor.evict.remote(kv.id, spill))


def free(kv: RemoteKVRef) -> None:
    _get(kv.replica.actor.free.remote(kv.id))


def pin(kv: RemoteKVRef, ttl_s: float | None = None) -> None:
    _get(kv.replica.actor.pin.remote(kv.id, ttl_s))


def unpin(kv: RemoteKVRef) -> None:
    _get(kv.replica.actor.unpin.remote(kv.id))


def generate(kv: RemoteKVRef, text_or_ids, max_new_tokens: int = 32, **sampling):
    return _get(kv.replica.actor.generate.remote(kv.id, text_or_ids, max_new_tokens, **sampling))
