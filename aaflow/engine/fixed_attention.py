"""Batch- and chunk-invariant attention: the engine's `deterministic` mode.

A token's attention output depends only on its query and on the keys and values at or before its
position, never on how its prompt was split into chunks, packed with other sequences' chunks or
batched in decode. The CPU flash kernel reduces over keys in tiles of 512 and merges the tiles in
order; a tile wholly masked for a query leaves its running sums unchanged (it adds exact zeros).
So every call here hands the kernel keys padded to a multiple of that tile, with an explicit mask
instead of `is_causal` (whose skipping depends on where the chunk starts), and at least
`MIN_QUERY_ROWS` query rows per kv head (fewer take another path with other rounding). With the
CPU's oneDNN matmuls, whose rows do not depend on how many rows are multiplied together (checked by
the engine's tests), the whole forward pass is then invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.engine.attention import run_start
from aaflow.engine.kv_cache import PagedKVCache

KEY_TILE = 512  # the flash kernel's key split for contexts of >= 512 keys
MIN_QUERY_ROWS = 4  # per kv head and call; 1-3 rows give other bits (measured on AVX512-BF16)
QUERY_TILE = 512  # queries per call in a long chunk: keys beyond the tile's last query are skipped

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns (out, logsumexp)


@dataclass(frozen=True)
class FixedPart:
    """One sequence's new tokens in a forward pass: tokens [offset, offset + n) of the pass sit at
    positions [start, start + n) of a context whose slots are `context` ([start + n])."""

    offset: int
    start: int
    n: int
    context: torch.Tensor  # [start + n]
    run_first: int | None  # the context is one run of slots starting here (read in place), or None


@dataclass
class FixedBatch:
    """Every sequence's new tokens in one forward pass, attended with `fixed_attention`."""

    write_slots: torch.Tensor  # [T] where each new token's K/V goes
    parts: list[FixedPart]

    @classmethod
    def of(cls, chunks: list[tuple[torch.Tensor, int]]) -> "FixedBatch":
        """chunks[i] = (context slots [start_i + n_i], start_i) of one sequence's n_i new tokens, in
        token order."""
        parts, offset = [], 0
        for context, start in chunks:
            n = context.numel() - start
            parts.append(FixedPart(offset, start, n, context, run_start(context)))
            offset += n
        return cls(torch.cat([c[s:] for c, s in chunks]), parts)


def _padded(n: int) -> int:
    return -(-n // KEY_TILE) * KEY_TILE


def _read_kv(cache: PagedKVCache, layer: int, contexts: list[torch.Tensor], length: int, first: int | None):
    """Each context's K/V padded to `length` keys (the padding is masked): ([B, Hkv, length, D]) x 2,
    read in place when there is one context, lying in one run of slots from `first` inside the pool,
    else gathered."""
    k_cache, v_cache = cache.layer(layer)  # [slots, Hkv, D]
    if len(contexts) == 1 and first is not None and first + length <= k_cache.shape[0]:
        return (k_cache[first:first + length][None].transpose(1, 2),
                v_cache[first:first + length][None].transpose(1, 2))
    slots = torch.zeros(len(contexts), length, dtype=torch.long)  # [B, length]; padding reads slot 0
    for b, context in enumerate(contexts):
        slots[b, : context.numel()] = context
    flat = slots.reshape(-1)
    shape = (len(contexts), length, k_cache.shape[1], k_cache.shape[2])
    return (k_cache.index_select(0, flat).view(shape).transpose(1, 2),
            v_cache.index_select(0, flat).view(shape).transpose(1, 2))


def _attend(q: torch.Tensor, positions: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    """q [B, S, H, D] at positions [B, S] over kh, vh [B, Hkv, L, D] (L a multiple of KEY_TILE):
    [B, S, H * D]. Query head h reads kv head h // G, folded into rows ordered (g, s)."""
    B, S, heads, dim = q.shape
    kv_heads, length = kh.shape[1], kh.shape[2]
    group = heads // kv_heads
    rows = max(group * S, MIN_QUERY_ROWS)
    qg = q.new_zeros(B, kv_heads, rows, dim)  # [B, Hkv, R, D]; rows past G * S are padding
    qg[:, :, : group * S] = q.view(B, S, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(B, kv_heads, -1, dim)
    row_pos = torch.full((B, rows), length, dtype=torch.long)  # padding rows see every key
    row_pos[:, : group * S] = positions.repeat(1, group)
    allowed = torch.arange(length)[None, None, :] <= row_pos[:, :, None]  # [B, R, L]
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))[:, None]
    out = _flash(qg, kh, vh, attn_mask=mask)[0][:, :, : group * S]  # [B, Hkv, G * S, D]
    return out.reshape(B, kv_heads, group, S, dim).permute(0, 3, 1, 2, 4).reshape(B, S, heads * dim)


def fixed_attention(
    layer: int,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D] (already rotated)
    v: torch.Tensor,  # [T, Hkv, D]
    cache: PagedKVCache,
    batch: FixedBatch,
) -> torch.Tensor:  # [T, H * D]
    """Store the new tokens' K/V, then attend each over its context, batch- and chunk-invariantly."""
    cache.write(layer, batch.write_slots, k, v)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    singles = [p for p in batch.parts if p.n == 1]  # decode steps: one batched call
    if singles:
        rows = torch.tensor([p.offset for p in singles])
        length = _padded(max(p.context.numel() for p in singles))
        kh, vh = _read_kv(cache, layer, [p.context for p in singles], length, singles[0].run_first)
        positions = torch.tensor([[p.start] for p in singles])  # [B, 1]
        out[rows] = _attend(q[rows][:, None], positions, kh, vh)[:, 0]
    for p in batch.parts:
        if p.n == 1:
            continue
        for a in range(0, p.n, QUERY_TILE):
            b = min(a + QUERY_TILE, p.n)
            stop = p.start + b  # keys this tile's queries may read
            kh, vh = _read_kv(cache, layer, [p.context[:stop]], _padded(stop), p.run_first)
            positions = torch.arange(p.start + a, stop)[None]  # [1, S]
            out[p.offset + a: p.offset + b] = _attend(q[p.offset + a: p.offset + b][None], positions, kh, vh)[0]
    return out
