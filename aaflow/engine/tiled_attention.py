"""Prefill attention of one sequence as tiles of plain matrix products, for bf16.

The new tokens' queries go in tiles of TILE_TOKENS positions. Each tile takes three steps:
- its scores against every key it may see come from one oneDNN product per kv head, with the
  head's query group folded into the rows;
- the causal triangle is masked on the tile's own diagonal block only;
- a bf16 softmax (computed in fp32 inside the kernel) and one product with V give its output.
Keys past the tile's last position are never read, so causal work is skipped tile by tile.

Why not torch's CPU flash kernel: it ran a causal prefill of SmolLM2's heads far below the
FLOP rate of its products; on an AMD EPYC with AVX512-BF16 the tiles took much less time per layer
at 512-4,096 tokens (docs/RESULTS-history.md).

The precision is that of Hugging Face's eager bf16 attention, not flash's. The scores are rounded
to bf16 before the softmax, and the probabilities are rounded before the product with V (flash
rounds those too). In bf16 the engine therefore takes tiles; fp32 takes the flash kernel through
the same batch (`TiledPrefillBatch` with `flash`), which also sends short chunks (a decoding
sequence's token in a mixed step) to the decode kernel and splits a long chunk after a cached
prefix into two unmasked flash calls: faster than the masked per-sequence path and than fp32 tiles
(docs/RESULTS.md, "fp32 attention read in place").

With AMX (Intel Sapphire Rapids and later) the balance turns: oneDNN runs the flash kernel's
blocks on the tile unit and tiles lose, fresh prompts and chunks over a cached context alike
(docs/RESULTS-history.md), so there bf16 prefill goes through the flash path (`prefill_kernel`;
`AAFLOW_PREFILL_ATTENTION` = `flash` or `tiles` overrides the choice), which runs the AMX kernel of
`amx_attention` for 64-dim heads, faster again than torch's flash per layer and over a whole
prefill.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from aaflow.engine.amx_attention import amx_attention, amx_kernel, merge_parts
from aaflow.engine.attention import run_start
from aaflow.engine.decode_kernel import KernelReads, kernel_attention
from aaflow.engine.kv_cache import PagedKVCache
from aaflow.engine.prefix_groups import PrefixGroup, prefix_groups
from aaflow.engine.shared_prefix_prefill import shared_prefix_attention, shared_prefix_tokens
from aaflow.common.machine import matrix_isa

TILE_TOKENS = 128  # 32 and 64 measured slower at 512-2,048 tokens (256 not tried in this form)
KERNEL_ROW_TOKENS = 8  # chunks this short go through the decode kernel, a row per token


def prefill_kernel(dtype: torch.dtype = torch.bfloat16) -> str:
    """Which kernel attends prefill chunks here: "flash" in fp32 and with AMX, else "tiles" (see
    above); `AAFLOW_PREFILL_ATTENTION` overrides."""
    chosen = os.environ.get("AAFLOW_PREFILL_ATTENTION", "").strip().lower()
    if chosen and chosen not in ("flash", "tiles"):
        raise ValueError(f"AAFLOW_PREFILL_ATTENTION={chosen!r}: use 'flash' or 'tiles' (or unset it)")
    return chosen or ("flash" if dtype == torch.float32 or matrix_isa() == "amx" else "tiles")


@functools.cache
def _diagonal_mask(dtype: torch.dtype) -> torch.Tensor:  # [TILE_TOKENS, TILE_TOKENS]: -inf above the diagonal
    return torch.full((TILE_TOKENS, TILE_TOKENS), float("-inf"), dtype=dtype).triu(1)


def tiled_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: positions [start, start + T)
    k: torch.Tensor,  # [start + T, Hkv, D]: the whole context, new tokens last (any row stride)
    v: torch.Tensor,  # [start + T, Hkv, D]
    start: int,
) -> torch.Tensor:  # [T, H * D]
    """Causal attention of T new tokens over their context (the first `start` keys plus themselves)."""
    T, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    mask = _diagonal_mask(q.dtype)
    qg = (q * dim ** -0.5).view(T, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, T * group, dim)  # rows (t, g)
    kt = k.permute(1, 2, 0)  # [Hkv, D, ctx]
    vh = v.transpose(0, 1)  # [Hkv, ctx, D]
    out = torch.empty(kv_heads, T, group, dim, dtype=q.dtype)  # [Hkv, T, G, D]
    # one buffer for every tile's scores: fresh multi-megabyte tensors per tile cost page faults
    buffer = torch.empty(kv_heads * min(T, TILE_TOKENS) * group * k.shape[0], dtype=q.dtype)
    for s in range(0, T, TILE_TOKENS):
        e = min(T, s + TILE_TOKENS)
        t, keys = e - s, start + e
        scores = buffer[: kv_heads * t * group * keys].view(kv_heads, t * group, keys)
        torch.matmul(qg[:, s * group:e * group], kt[:, :, :keys], out=scores)  # [Hkv, t*G, keys]
        scores.view(kv_heads, t, group, keys)[..., start + s:] += mask[:t, :t][None, :, None, :]
        torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # in place; bf16 out, fp32 inside
        out[:, s:e] = torch.matmul(scores, vh[:, :keys]).view(kv_heads, t, group, dim)
    return out.transpose(0, 1).reshape(T, heads * dim)


def flash_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: positions [start, start + T)
    k: torch.Tensor,  # [start + T, Hkv, D]: the whole context, new tokens last (any row stride)
    v: torch.Tensor,  # [start + T, Hkv, D]
    start: int,
) -> torch.Tensor:  # [T, H * D]
    """`tiled_prefill_attention` through the AMX kernel where it runs (`amx_attention`), else torch's
    flash kernel (fp32 scores inside). There a mask makes the
    kernel compute the masked triangle too, so where the new tokens are at least as many as the
    keys before them, the two parts go apart: the earlier keys unmasked, the new ones causal, merged
    by their log-sum-exps (docs/RESULTS-history.md)."""
    T = q.shape[0]
    kernel = amx_kernel(q)
    if kernel is not None:  # one call whatever `start`: blocks past the diagonal are skipped
        return amx_attention(kernel, q, k, v, start)[0].view(T, -1)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, heads, n, D]
    if start == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    elif T >= start:
        out = _causal_after_prefix(qh, kh, vh, start)
    else:  # query i (position start + i) sees keys 0..start + i
        allowed = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(T))[:, None]  # [T, ctx]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed[None, None], enable_gqa=True)
    return out[0].transpose(0, 1).reshape(T, -1)  # [1, H, T, D] -> [T, H * D]


def _causal_after_prefix(
    qh: torch.Tensor,  # [1, H, T, D]
    kh: torch.Tensor,  # [1, Hkv, start + T, D]
    vh: torch.Tensor,  # [1, Hkv, start + T, D]
    start: int,
) -> torch.Tensor:  # [1, H, T, D]
    """Attention over `start` earlier keys (all visible) and T new ones (causal), as two flash calls
    merged by their log-sum-exps; the parts are rounded to the dtype before the merge."""
    group = qh.shape[1] // kh.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (out [1, H, T, D], lse [1, H, T])
    expand = lambda x: x.repeat_interleave(group, dim=1)  # noqa: E731  [1, Hkv, n, D] -> [1, H, n, D]
    before, lse_before = flash(qh, expand(kh[:, :, :start]), expand(vh[:, :, :start]), 0.0, False)
    new, lse_new = flash(qh, expand(kh[:, :, start:]), expand(vh[:, :, start:]), 0.0, True)
    return merge_parts(before, lse_before, new, lse_new)


@dataclass
class TiledPrefillBatch:
    """Prefill chunks of one or more sequences packed along the token axis; each attends alone over
    its whole context, read in place when it is one run of slots, else gathered, in tiles or through
    the flash kernel (`flash`, see `prefill_kernel`). With the decode
    kernel, the tokens of short chunks (`KERNEL_ROW_TOKENS` or fewer, such as a streamed agent's
    increments) go through it instead, one query row per token over the context before it: one
    call per layer for all of them, where tiles cost a dozen torch calls per chunk."""

    write_slots: torch.Tensor  # [T]: each new token's slot, sequence by sequence
    contexts: list[torch.Tensor]  # [start_i + S_i] slots of sequence i's context, its new tokens last
    starts: list[int]  # position of sequence i's first new token
    offsets: list[int]  # [len(contexts) + 1]: sequence i's new tokens are rows [offsets[i], offsets[i + 1])
    read_starts: list[int | None]  # first slot of context i when it is one run, else None
    tiled: list[int]  # the sequences attended in tiles
    row_tokens: torch.Tensor | None = None  # [N] token rows that go through the kernel
    rows: KernelReads | None = None  # their contexts
    flash: bool = False  # the tiled sequences go through the flash kernel instead of tiles
    shared: int = 0  # with flash: leading slots all tiled sequences share, attended once (cascade)
    groups: list[PrefixGroup] = field(default_factory=list)  # in tiles: chunks over one cached prefix, together

    @classmethod
    def build(cls, contexts: list[torch.Tensor], starts: list[int], kernel_rows: bool = False,
              flash: bool = False) -> "TiledPrefillBatch":
        offsets, tiled, row_tokens, row_contexts = [0], [], [], []
        for i, (context, start) in enumerate(zip(contexts, starts)):
            new = context.numel() - start
            offsets.append(offsets[-1] + new)
            if kernel_rows and new <= KERNEL_ROW_TOKENS:
                row_tokens.extend(range(offsets[i], offsets[i + 1]))
                row_contexts.extend(context[: start + t + 1] for t in range(new))  # causal: up to itself
            else:
                tiled.append(i)
        write = torch.cat([context[start:] for context, start in zip(contexts, starts)])
        batch = cls(write, contexts, starts, offsets, [run_start(c) for c in contexts], tiled, flash=flash)
        if flash:
            batch.shared = shared_prefix_tokens([contexts[i] for i in tiled], [starts[i] for i in tiled])
        else:
            batch.groups, batch.tiled = prefix_groups(tiled, contexts, starts, offsets)
        if row_tokens:
            batch.row_tokens, batch.rows = torch.tensor(row_tokens), KernelReads.of(row_contexts)
        return batch

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return tiled_attention(layer, q, k, v, cache, self)


def tiled_attention(
    layer: int,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D] (already rotated)
    v: torch.Tensor,  # [T, Hkv, D]
    cache: PagedKVCache,
    batch: TiledPrefillBatch,
) -> torch.Tensor:  # [T, H * D]
    cache.write(layer, batch.write_slots, k, v)
    k_cache, v_cache = cache.layer(layer)  # [slots, Hkv, D]
    if batch.shared:
        outs = _shared_prefix(q, k_cache, v_cache, batch)
    else:
        outs, attend = [], flash_prefill_attention if batch.flash else tiled_prefill_attention
        for i in batch.tiled:
            context, start, first = batch.contexts[i], batch.starts[i], batch.read_starts[i]
            a, b = batch.offsets[i], batch.offsets[i + 1]
            if start == 0:  # a fresh prompt: its keys are the new tokens themselves
                kc, vc = k[a:b], v[a:b]
            elif first is not None:  # one run of slots: views of the pool, no copy
                kc, vc = k_cache[first:first + context.numel()], v_cache[first:first + context.numel()]
            else:
                kc, vc = k_cache.index_select(0, context), v_cache.index_select(0, context)  # [ctx, Hkv, D]
            outs.append(attend(q[a:b], kc, vc, start))
    if batch.rows is None and not batch.groups:
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)  # [T, H * D]
    if batch.rows is not None:
        out[batch.row_tokens] = kernel_attention(q[batch.row_tokens], k_cache, v_cache, batch.rows)
    for i, part in zip(batch.tiled, outs):
        out[batch.offsets[i]:batch.offsets[i + 1]] = part
    for group in batch.groups:
        out[group.rows] = group.attend(q, k_cache, v_cache)
    return out


def _shared_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: TiledPrefillBatch) -> list[torch.Tensor]:
    """The tiled sequences' outputs, their shared prefix attended once (`shared_prefix_attention`):
    the prefix's K/V read from the first sequence's slots, each sequence's own keys gathered."""
    prefix = batch.contexts[batch.tiled[0]][:batch.shared]
    first = run_start(prefix)
    if first is not None:
        prefix_k, prefix_v = k_cache[first:first + batch.shared], v_cache[first:first + batch.shared]
    else:
        prefix_k, prefix_v = k_cache.index_select(0, prefix), v_cache.index_select(0, prefix)
    own = [batch.contexts[i][batch.shared:] for i in batch.tiled]
    return shared_prefix_attention([q[batch.offsets[i]:batch.offsets[i + 1]] for i in batch.tiled], prefix_k, prefix_v,
                                   [k_cache.index_select(0, s) for s in own], [v_cache.index_select(0, s) for s in own],
                                   [batch.starts[i] for i in batch.tiled])
