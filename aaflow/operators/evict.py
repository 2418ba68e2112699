"""evict / free / pin / unpin: the lifecycle of a KVRef's memory."""

from __future__ import annotations

from aaflow.operators.ref import KVRef, check_ref


def evict(kv: KVRef, spill: bool | None = None) -> None:
    """Drop kv's blocks from the pool; the next use rebuilds it from lineage (or reloads it from
    disk when spilled). Blocks shared with forks stay until their last user is gone."""
    check_ref(kv, "evict").host.evict(kv, spill=spill)


def free(kv: KVRef) -> None:
    """End kv for good: its blocks are released and any later use raises `KVRefFreedError`."""
    check_ref(kv, "free").host.free(kv)


def pin(kv: KVRef, ttl_s: float | None = None) -> None:
    """Keep kv resident under budget pressure, for `ttl_s` seconds or until `unpin`."""
    check_ref(kv, "pin").host.pin(kv, ttl_s)


def unpin(kv: KVRef) -> None:
    check_ref(kv, "unpin").host.unpin(kv)
