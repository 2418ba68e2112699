"""Generating from a KV context: `af.generate(kv, prompt)` on an in-process KVRef.

Not an operator: it runs the engine's generation loop on a fork of the ref, so it lives in the
cluster layer beside the replica that hosts the engine, not in `operators` (which know no concrete
engine).
"""

from __future__ import annotations

from typing import Sequence

from dataclasses import fields

from aaflow.engine.sampling import SamplingParams
from aaflow.common.errors import SamplingError
from aaflow.operators.ref import KVRef, Lineage, check_ref


def generate(kv: KVRef, text_or_ids: str | Sequence[int], max_new_tokens: int = 32, *,
             keep_kv: bool = False, **sampling):
    """Continue kv's context with a prompt and generate; kv itself is unchanged (forked).

    Returns the engine's `GenerationOutput`; with `keep_kv`, `out.kv` is a KVRef for the
    continued context (kv + prompt + the generated tokens but the last).
    Sampling keywords: temperature, top_p, seed, stop, ignore_eos.
    """
    host = check_ref(kv, "generate").host
    params = sampling_params(max_new_tokens, sampling)
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


def sampling_params(max_new_tokens, sampling: dict) -> SamplingParams:
    """`SamplingParams` from generate's keywords; `SamplingError` names an unknown keyword or a bad stop."""
    known = {f.name for f in fields(SamplingParams)} - {"max_new_tokens"}
    unknown = sorted(set(sampling) - known)
    if unknown:
        raise SamplingError(f"unknown sampling keyword {unknown[0]!r}; use {', '.join(sorted(known))}")
    if "stop" in sampling:
        stop = sampling["stop"]
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise SamplingError(f"stop must be a string or a list of strings, got {stop!r}")
        sampling = {**sampling, "stop": tuple(stop)}
    return SamplingParams(max_new_tokens=max_new_tokens, **sampling)
