"""materialize (text -> KV), extend (KV + text -> KV) and generate (continue a KV context)."""

from __future__ import annotations

from typing import Sequence

from operators.host import KVHost
from operators.ref import KVRef, Lineage


def materialize(host: KVHost, text_or_ids: str | Sequence[int], *, lineage: bool = True,
                chunk_size: int | None = None) -> KVRef:
    """Prefill a context on `host`'s engine and return its KVRef.

    The prefix cache serves any full blocks already computed for the same prefix. With
    `lineage=False` the ref cannot be rebuilt after eviction (eviction is then final).
    """
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
    host = kv.host
    ids = host.engine.prompt_ids(text_or_ids)  # PromptError when empty or outside the vocabulary
    seq = host.engine.fork(host.sequence(kv))
    try:
        host.engine.prefill(seq, ids, chunk_size)
    except Exception:
        host.engine.free(seq)
        raise
    lineage = Lineage("materialize", (kv.id,), (("continuation", "true"),)) if kv.lineage else None
    return host.register(seq, lineage, kv.fidelity)


def generate(kv: KVRef, text_or_ids: str | Sequence[int], max_new_tokens: int = 32, *,
             keep_kv: bool = False, **sampling):
    """Continue kv's context with a prompt and generate; kv itself is unchanged (forked).

    Returns the engine's `GenerationOutput`; with `keep_kv`, `out.kv` is a KVRef for the
    continued context (kv + prompt + the generated tokens but the last).
    Sampling keywords: temperature, top_p, seed, stop, ignore_eos.
    """
    from aaflow.engine.sampling import SamplingParams

    host = kv.host
    params = SamplingParams(max_new_tokens=max_new_tokens, **{k: tuple(v) if k == "stop" else v
                                                              for k, v in sampling.items()})
    seq = host.engine.fork(host.sequence(kv))
    try:
        out = host.engine.generate_batch([text_or_ids], params, seq_ids=[seq], keep=True)[0]
    except Exception:
        host.engine.free(seq)
        raise
    if keep_kv:
        out.kv = host.register(seq, Lineage("generate", (kv.id,)) if kv.lineage else None, kv.fidelity)
    else:
        host.engine.free(seq)
    return out
