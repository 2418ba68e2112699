"""Batch- and chunk-invariant attention: the engine's `deterministic` mode.

A token's attention output depends only on its query and on the keys and values at or before its
position, never on how its prompt was split into chunks, packed with other sequences' chunks or
batched in decode. The CPU flash kernel reduces over keys in tiles of 512 and merges the tiles in
order; a tile wholly masked for a query leaves its running sums unchanged (it adds exact zeros).
So every call here hands the kernel keys padded to a multiple of that tile, with an explicit mask
instead of `is_causal` (whose skipping depends on where the chunk starts), and query rows per kv
head padded to a multiple of `QUERY_ROW_MULTIPLE`: the kernel splits rows into blocks of 32, 64 or
256, and a block of 1-3 rows (a short call, or the tail of a long one) takes another path with
other rounding. oneDNN's bf16 matmuls give a row the same bits whatever the number of rows, except
for a single row (run as two) and, over long reductions (the down projection), some row counts
(those run on the AMX kernel, or in oneDNN calls of a fixed size: `Linear(x, batch_invariant=True)`),
so the whole forward pass is then invariant (tests/engine/test_engine_deterministic.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.engine.attention import pad_slots, run_start
from aaflow.engine.kv_cache import PagedKVCache

KEY_TILE = 512  # the flash kernel's key split for contexts of >= 512 keys
QUERY_ROW_MULTIPLE = 8  # per kv head and call: every row block then has >= 8 rows (1-3 round otherwise)
QUERY_TILE = 512  # queries per call in a long chunk: keys beyond the tile's last query are skipped

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns (out, logsumexp)


@dataclass(frozen=True)
class _Call:
    """One flash call of a pass, the same in every layer: `rows` of the pass's new tokens, B
    sequences of S queries each, over `length` keys (padded; `mask` hides what a query may not see)."""

    rows: torch.Tensor  # [B * S] token rows of the pass, sequence-major
    batch: int
    queries: int
    length: int
    first: int | None  # one sequence whose keys lie in one run of slots from here: read in place
    slots: torch.Tensor | None  # [B * length] slots to gather when not read in place (padding: slot 0)
    mask: torch.Tensor  # [B, 1, R, length] additive: 0 = may attend, -inf = may not


class FixedBatch:
    """Every sequence's new tokens in one forward pass, attended with `fixed_attention`. The calls
    (which keys, which mask) are worked out once, in the first layer, and reused by the others."""

    def __init__(self, chunks: list[tuple[torch.Tensor, int]]) -> None:
        """chunks[i] = (context slots [start_i + n_i], start_i) of one sequence's n_i new tokens, in
        token order."""
        self.chunks = chunks
        self.write_slots = torch.cat([c[s:] for c, s in chunks])  # [T] where each new token's K/V goes
        self._calls: list[_Call] | None = None

    def calls(self, num_slots: int, group: int, dtype: torch.dtype) -> list[_Call]:
        if self._calls is None:
            self._calls = list(self._plan(num_slots, group, dtype))
        return self._calls

    def _plan(self, num_slots: int, group: int, dtype: torch.dtype):
        offsets = torch.tensor([0] + [c.numel() - s for c, s in self.chunks]).cumsum(0).tolist()
        singles = [i for i, (c, s) in enumerate(self.chunks) if c.numel() - s == 1]  # decode steps: one call
        if singles:
            contexts = [self.chunks[i][0] for i in singles]
            positions = torch.tensor([[self.chunks[i][1]] for i in singles])  # [B, 1]
            yield _call(torch.tensor([offsets[i] for i in singles]), contexts, positions, num_slots, group, dtype)
        for i, (context, start) in enumerate(self.chunks):
            n = context.numel() - start
            for a in range(0, n if n > 1 else 0, QUERY_TILE):
                b = min(a + QUERY_TILE, n)
                positions = torch.arange(start + a, start + b)[None]  # [1, S]
                rows = torch.arange(offsets[i] + a, offsets[i] + b)
                yield _call(rows, [context[: start + b]], positions, num_slots, group, dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return fixed_attention(layer, q, k, v, cache, self)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _call(rows, contexts, positions, num_slots: int, group: int, dtype: torch.dtype) -> _Call:
    """contexts: each sequence's slots up to its last query; positions: [B, S] of the queries."""
    B, S = positions.shape
    length = _round_up(max(c.numel() for c in contexts), KEY_TILE)
    first = run_start(contexts[0]) if B == 1 else None
    slots = None
    if first is None or first + length > num_slots:
        first, slots = None, pad_slots(contexts, length).reshape(-1)
    row_count = _round_up(group * S, QUERY_ROW_MULTIPLE)
    row_pos = torch.full((B, row_count), length, dtype=torch.long)  # padding rows see every key
    row_pos[:, : group * S] = positions.repeat(1, group)  # rows ordered (g, s)
    allowed = torch.arange(length)[None, None, :] <= row_pos[:, :, None]  # [B, R, length]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))[:, None]
    return _Call(rows, B, S, length, first, slots, mask)


def _read_kv(cache: PagedKVCache, layer: int, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's K and V: [B, Hkv, length, D] each, views of the pool or gathered."""
    k_cache, v_cache = cache.layer(layer)  # [slots, Hkv, D]
    if call.slots is None:
        a, b = call.first, call.first + call.length
        return k_cache[a:b][None].transpose(1, 2), v_cache[a:b][None].transpose(1, 2)
    shape = (call.batch, call.length, k_cache.shape[1], k_cache.shape[2])
    return (k_cache.index_select(0, call.slots).view(shape).transpose(1, 2),
            v_cache.index_select(0, call.slots).view(shape).transpose(1, 2))


def fixed_attention(
    layer: int,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D] (already rotated)
    v: torch.Tensor,  # [T, Hkv, D]
    cache: PagedKVCache,
    batch: FixedBatch,
) -> torch.Tensor:  # [T, H * D]
    """Store the new tokens' K/V, then attend each over its context, batch- and chunk-invariantly.
    Query head h reads kv head h // G; a call folds each kv head's G query heads into its rows."""
    cache.write(layer, batch.write_slots, k, v)
    T, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    out = q.new_empty(T, heads * dim)
    for call in batch.calls(cache.layout.num_blocks * cache.layout.block_size, group, q.dtype):
        B, S = call.batch, call.queries
        kh, vh = _read_kv(cache, layer, call)
        qg = q.new_zeros(B, kv_heads, call.mask.shape[2], dim)  # [B, Hkv, R, D]; rows past G * S: padding
        qg[:, :, : group * S] = q[call.rows].view(B, S, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(
            B, kv_heads, group * S, dim)
        o = _flash(qg, kh, vh, attn_mask=call.mask)[0][:, :, : group * S]  # [B, Hkv, G * S, D]
        out[call.rows] = o.reshape(B, kv_heads, group, S, dim).permute(0, 3, 1, 2, 4).reshape(B * S, heads * dim)
    return out
