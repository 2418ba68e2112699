"""The five operators on a cluster: `RemoteKVRef` handles and the functions `af.*` dispatch to.

A `RemoteKVRef` names KV living in a replica actor; KV bytes only move through transports. Calls
go through `aaflow.cluster.replica_calls` (one error mapping: a dead replica or a cluster shut down
raises `ClusterError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from aaflow.common.errors import KVLocationError, KVTransferError, ModelMismatchError
from aaflow.runtime.calls import ComposeCall, EvictCall, FreeCall, MaterializeCall
from aaflow.runtime.kv_move import move_now
from aaflow.runtime.operator_calls import ForkCall, GenerateCall, PinCall, UnpinCall
from aaflow.cluster.cluster import Cluster, ClusterError, ReplicaHandle
from aaflow.runtime.replies import RefRecord
from aaflow.cluster.replica_api import default_transport
from aaflow.cluster.replica_calls import call


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


def materialize(cluster: Cluster, model: str, text_or_ids: str | Sequence[int], *, replica: ReplicaHandle | None = None,
                lineage: bool = True) -> RemoteKVRef:
    """Prefill a context on a replica of `model` (the given one, or the first) and return its handle."""
    candidates = cluster.replicas(model)
    if not candidates:
        raise ModelMismatchError(f"the cluster serves no replica of {model!r} (serves {sorted(cluster.models)})")
    target = replica or candidates[0]
    return RemoteKVRef(call(target, MaterializeCall(text_or_ids, lineage)), target)


def transfer(kv: RemoteKVRef, destination: ReplicaHandle, transport: str | None = None) -> RemoteKVRef:
    """An exact copy of kv's blocks on `destination` (a fork when it is already there), over
    `transport` (default: `aaflow.cluster.replica_api.default_transport` of both replicas' engines)."""
    if not isinstance(destination, ReplicaHandle):
        raise KVLocationError(f"transfer needs a replica handle (cluster.replicas(model)[i]) for a cluster KVRef, "
                              f"got {type(destination).__name__}")
    if destination.name == kv.replica.name:
        return fork(kv, 1)[0]
    transport = transport or default_transport({kv.replica.engine, destination.engine})
    try:
        received = move_now(call, kv.replica, destination, kv.id, transport).record
    except ClusterError as err:
        raise KVTransferError(f"transfer of {kv.id} to {destination.name} failed: {err}; "
                              f"{kv.id} is intact on {kv.replica.name}") from err
    return RemoteKVRef(received, destination)


def fork(kv: RemoteKVRef, n: int = 2) -> list[RemoteKVRef]:
    return [RemoteKVRef(r, kv.replica) for r in call(kv.replica, ForkCall(kv.id, n))]


def compose(*kvs: RemoteKVRef, mode: str = "exact", r: float = 0.15) -> RemoteKVRef:
    home = kvs[0].replica
    for kv in kvs[1:]:
        if kv.replica.name != home.name:
            raise KVLocationError(f"cannot compose {kvs[0].id} on {home.name} with {kv.id} on {kv.replica.name}: "
                                  "transfer one of them first (af.transfer(kv, replica))")
    return RemoteKVRef(call(home, ComposeCall([k.id for k in kvs], mode, r)), home)


def evict(kv: RemoteKVRef, spill: bool | None = None) -> None:
    call(kv.replica, EvictCall(kv.id, spill))


def free(kv: RemoteKVRef) -> None:
    call(kv.replica, FreeCall(kv.id))


def pin(kv: RemoteKVRef, ttl_s: float | None = None) -> None:
    call(kv.replica, PinCall(kv.id, ttl_s))


def unpin(kv: RemoteKVRef) -> None:
    call(kv.replica, UnpinCall(kv.id))


def generate(kv: RemoteKVRef, text_or_ids, max_new_tokens: int = 32, **sampling):
    return call(kv.replica, GenerateCall(kv.id, text_or_ids, max_new_tokens, sampling=sampling))
