"""compose: one KVRef for the concatenated context of several refs, exact or reported approximate.

Each part is placed after everything composed before it:
  * a part whose tokens start with the context so far was computed with that context as its
    prefix: its tail is exact and is used as is;
  * any other part is an independent segment: `exact` refuses it; `rerotate` moves its keys to
    their new positions (RoPE rotations compose; values unchanged); `blend` re-rotates, then
    recomputes the fraction `r` of its tokens: its last token (which what follows reads most), then
    those whose KV deviates most (CacheBlend-style).
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

import torch

from aaflow.common.errors import KVComposeError, KVLocationError
from aaflow.operators.payload import KVPayload
from aaflow.operators.ref import FidelityReport, KVRef, Lineage, check_ref


def compose(*kvs: KVRef, mode: Literal["exact", "rerotate", "blend"] = "exact", r: float = 0.15,
            check: Sequence[int] | None = None) -> KVRef:
    """A ref for the concatenation of the parts' contexts (see the module doc for the rules).

    Args:
        mode: "exact" (raises `KVComposeError` unless every part continues the ones before it),
            "rerotate" or "blend".
        r: blend's recompute fraction of each independent segment's tokens, 0 <= r <= 1.
        check: probe token ids; if given, the fidelity report compares next-token logits after the
            probe against a full recompute of the composed context (costs one full prefill).
    Non-exact results carry `ref.fidelity`; an all-continuation compose is exact in any mode.
    """
    if not kvs:
        raise KVComposeError("compose needs at least one KVRef")
    for part in kvs:
        check_ref(part, "compose")
    if not isinstance(mode, str) or mode not in ("exact", "rerotate", "blend"):
        raise KVComposeError(f"unknown compose mode {mode!r}: use 'exact', 'rerotate' or 'blend'")
    if mode == "blend" and not (isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1):
        raise KVComposeError(f"blend's recompute fraction r must be a number in [0, 1], got {r!r}")
    host = kvs[0].host
    for part in kvs[1:]:
        if part.host is not host:
            raise KVLocationError(
                f"cannot compose {kvs[0].id} on {kvs[0].replica} with {part.id} on {part.replica}: "
                f"transfer one of them first (af.transfer(kv, host))"
            )
    parts = [(part.id, part.token_ids, host.engine.export_kv(host.sequence(part)).kv) for part in kvs]
    tokens, kv, moved = join_parts(parts, mode, host.engine.shift_keys)
    payload = KVPayload(host.fingerprint, tuple(tokens), kv)
    seq = host.engine.import_kv(payload, cacheable=not moved)  # approximate KV never serves prefix hits
    fidelity = None
    if moved:
        fidelity = FidelityReport(mode, total_tokens=len(tokens))
        if mode == "blend":
            candidates = [p for start, stop in moved for p in range(start, stop)]
            result = host.engine.blend(seq, candidates, r, anchors=[stop - 1 for _, stop in moved])
            fidelity = FidelityReport(mode, recomputed_tokens=len(result.recomputed_positions),
                                      total_tokens=len(tokens), mean_deviation=result.mean_deviation)
        if check is not None:
            top1, kl = next_token_agreement(host, seq, tokens, list(check))
            fidelity = FidelityReport(**{**fidelity.__dict__, "top1_agreement": top1, "kl_divergence": kl})
    detail = (("mode", mode), ("r", str(r))) if mode == "blend" else (("mode", mode),)
    lineage = Lineage("compose", tuple(k.id for k in kvs), detail) if all(k.lineage for k in kvs) else None
    return host.register(seq, lineage, fidelity)


def join_parts(parts: Sequence[tuple[str, Sequence[int], torch.Tensor]], mode: str,
               shift_keys: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[list[int], torch.Tensor, list]:
    """The tensor side of compose, for any engine.

    parts: (ref id, token ids, KV [layers, 2, n_i, kv_heads, head_dim]) in order; shift_keys(kv,
    delta) returns kv with its keys re-rotated by delta positions. Returns the composed token ids,
    the composed KV [layers, 2, n, kv_heads, head_dim] and the (start, stop) of every independent
    segment (empty when the result is exact). Raises `KVComposeError` for `exact` on independent parts.
    """
    tokens: list[int] = []
    pieces: list[torch.Tensor] = []  # [layers, 2, n_i, kv_heads, head_dim] each
    moved: list[tuple[int, int]] = []  # (start, stop) of independent segments in the composed context
    for ref_id, ids, kv in parts:
        if list(ids[: len(tokens)]) == tokens:  # continues the context so far
            pieces.append(kv[:, :, len(tokens):])
            tokens = list(ids)
            continue
        if mode == "exact":
            raise KVComposeError(
                f"exact compose needs each part computed with the parts before it as its prefix, but "
                f"{ref_id} ({len(ids)} tokens) does not start with the {len(tokens)} tokens before it; "
                "use mode='rerotate' or mode='blend' (approximate, with a fidelity report), or "
                "materialize the concatenated text"
            )
        pieces.append(shift_keys(kv, len(tokens)))
        moved.append((len(tokens), len(tokens) + len(ids)))
        tokens += list(ids)
    return tokens, torch.cat(pieces, dim=2), moved


def next_token_agreement(host, seq: int, tokens: list[int], probe: list[int]) -> tuple[float, float]:
    """Over every probe position: the fraction of top-1 next tokens that agree, and the mean
    KL(recompute || composed), comparing the composed sequence with a full recompute of tokens + probe."""
    agree, kl = agreement_by_position(host, seq, tokens, probe)
    return float(agree.mean()), float(kl.mean())


def agreement_by_position(host, seq: int, tokens: list[int], probe: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-force `probe` after the composed sequence and after a full recompute of `tokens`;
    returns, per probe position, whether the top-1 next tokens agree (1.0 / 0.0) and
    KL(recompute || composed), both [len(probe)] float64."""
    engine = host.engine
    trial = engine.fork(seq)
    reference = engine.new_sequence()
    try:
        approx = engine.prefill(trial, probe, all_logits=True)  # [len(probe), vocab]
        exact = engine.prefill(reference, tokens + probe, all_logits=True)[-len(probe):]
    finally:
        engine.free(trial)
        engine.free(reference)
    log_p, log_q = torch.log_softmax(exact.double(), -1), torch.log_softmax(approx.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [len(probe)]
    agree = (exact.argmax(-1) == approx.argmax(-1)).double()  # [len(probe)]
    return agree, kl
