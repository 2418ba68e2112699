"""transfer: an exact copy of a KVRef's blocks on another engine of the same model."""

from __future__ import annotations

from aaflow.common.errors import InvalidArgumentError, ModelMismatchError
from aaflow.operators.fork import fork
from aaflow.operators.host import KVHost
from aaflow.operators.ref import KVRef, Lineage, check_ref


def transfer(kv: KVRef, destination: KVHost) -> KVRef:
    """A ref for kv's context on `destination`, with bit-identical KV.

    Same host: the blocks are shared (no copy). Another engine in this process: one export and
    one import (checked against fingerprint, shape and dtype). A destination serving a different
    model raises `ModelMismatchError` before anything is copied.
    """
    check_ref(kv, "transfer")
    if not isinstance(destination, KVHost):
        raise InvalidArgumentError(f"transfer needs a destination KVHost, got {type(destination).__name__}")
    if destination is kv.host:
        return fork(kv, 1)[0]
    if destination.fingerprint != kv.fingerprint:
        raise ModelMismatchError(
            f"cannot transfer KV of model {kv.fingerprint[:12]}... from {kv.replica} to {destination.name}, "
            f"which serves model {destination.fingerprint[:12]}...; stream the text instead (recompute)"
        )
    export = kv.host.engine.export_kv(kv.host.sequence(kv))
    seq = destination.engine.import_kv(export, cacheable=kv.exact)
    lineage = Lineage("transfer", (kv.id,), (("from", kv.replica),)) if kv.lineage else None
    return destination.register(seq, lineage, kv.fidelity)
