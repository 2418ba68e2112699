"""fork: n refs sharing one context's blocks copy-on-write, so memory is paid once."""

from __future__ import annotations

from aaflow.common.errors import InvalidArgumentError
from aaflow.operators.ref import KVRef, Lineage, check_ref


def check_fork_count(n) -> None:
    """`InvalidArgumentError` (a ValueError) unless n is an int >= 1 (every engine's fork)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError(f"fork needs n >= 1 (an int), got {n!r}")


def fork(kv: KVRef, n: int = 2) -> list[KVRef]:
    """n new refs for kv's context. No block is copied until a ref's sequence writes into a
    shared partial block (then only that block is copied)."""
    check_fork_count(n)
    host = check_ref(kv, "fork").host
    seq = host.sequence(kv)
    lineage = Lineage("fork", (kv.id,)) if kv.lineage else None
    forks = [host.engine.fork(seq) for _ in range(n)]  # all before registering: a budget may evict kv
    return [host.register(f, lineage, kv.fidelity) for f in forks]
