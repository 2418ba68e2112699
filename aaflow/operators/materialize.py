"""materialize (text -> KV) and extend (KV + text -> KV)."""

from __future__ import annotations

from typing import Sequence

from aaflow.operators.host import KVHost
from aaflow.common.errors import InvalidArgumentError
from aaflow.operators.ref import KVRef, Lineage, check_ref


def materialize(host: KVHost, text_or_ids: str | Sequence[int], *, lineage: bool = True,
                chunk_size: int | None = None) -> KVRef:
    """Prefill a context on `host`'s engine and return its KVRef.

    The prefix cache serves any full blocks already computed for the same prefix. With
    `lineage=False` the ref cannot be rebuilt after eviction (eviction is then final).
    """
    if not isinstance(host, KVHost):
        raise InvalidArgumentError(f"materialize needs a KVHost or an engine, got {type(host).__name__}")
    ids = host.engine.prompt_ids(text_or_ids)  # PromptError when empty or outside the vocabulary
    seq = host.engine.new_sequence()
    try:
        host.engine.prefill(seq, ids, chunk_size)
    except Exception:
        host.engine.free(seq)
        raise
    return host.register(seq, Lineage("materialize") if lineage else None)


def extend(kv: KVRef, text_or_ids: str | Sequence[int], *, chunk_size: int | None = None) -> KVRef:
    """A new ref for kv's context followed by more tokens (incremental prefill; kv is unchanged).

    The result is exact: its KV equals a one-pass prefill of the whole context.
    """
    host = check_ref(kv, "extend").host
    ids = host.engine.prompt_ids(text_or_ids)  # PromptError when empty or outside the vocabulary
    seq = host.engine.fork(host.sequence(kv))
    try:
        host.engine.prefill(seq, ids, chunk_size)
    except Exception:
        host.engine.free(seq)
        raise
    lineage = Lineage("materialize", (kv.id,), (("continuation", "true"),)) if kv.lineage else None
    return host.register(seq, lineage, kv.fidelity)
