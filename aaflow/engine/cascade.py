"""Shared-prefix (cascade) attention for sequences whose contexts begin with the same cached blocks.

Sequences forked from one context, or served the same blocks by the prefix cache, read identical
K/V for that prefix. Gathering it once and attending to it with every sequence's new queries
stacked (GQA groups folded into the query axis) turns one small product per sequence into one
large one; each sequence's own remainder (its private blocks and new tokens) is attended
separately, and the two partial results merge exactly through their log-sum-exp (a softmax over
the union of the two key sets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aaflow.engine.amx_attention import amx_attention, amx_kernel, merge_parts
from aaflow.engine.attention import AttentionBatch, PackedBatch, run_start, write_and_gather
from aaflow.engine.kv_cache import PagedKVCache

# The second attention pass and the merge pay off once the prefix reads they save (shared tokens x
# (sequences - 1)) reach this; measured on SmolLM2 decode: 545 shared tokens x 2 sequences was 12%
# slower with cascade, x 8 sequences 18% faster; 4,096 x 16 was 6x faster.
CASCADE_MIN_SAVED_TOKENS = 1536
# One sequence whose context starts with a long run of consecutive blocks: attending to the run as
# views, without a mask, apart from the rest pays off from here on. Measured on SmolLM2 bf16, 30
# layers of attention: 16 new tokens over 4,096 + 16 scattered, 64 ms against 103 ms gathered; in one
# run, 118 against 130 ms with a mask; 512 over 2,048: 712 against 917 ms. A decode step over a
# context in one run needs no mask and reads it in place in one pass (~10% faster than split).
SPLIT_MIN_RUN_TOKENS = 512
# With AMX, a decode step of this many sequences or more that share a prefix runs faster in cascade
# (the prefix's scores for every sequence in one oneDNN product per kv head) than in the kernel,
# whose AVX512-BF16 dot products are the bound (SmolLM2 bf16, 2,000 shared + 100 own tokens each,
# 2 threads, ms a step, kernel / cascade: 3 seqs 38 / 42, 8 51 / 50, 12 58 / 52, 32 100 / 69,
# 64 176 / 102). On an AMD EPYC's AVX512-BF16 the kernel won at 12 (45-71 against 72-90 ms).
CASCADE_DECODE_MIN_BATCH = 12
# ... and once the shared prefix is long: its tokens x the sequences reach this. Below, the kernel
# (each key's row read once, prefetched) wins even at 64 sequences. ms a step, kernel / cascade,
# same setup, shared + own tokens: 64 x (48 + 60) 49-53 / 57-61, 64 x (48 + 110) 54 / 66-70,
# 64 x (256 + 100) 62-64 / 69, 64 x (512 + 100) 76-77 / 70-75, 16 x (2,000 + 60) 55 / 49,
# 64 x (2,000 + 100) 148-152 / 89-91.
CASCADE_DECODE_MIN_SHARED_READS = 32768

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns (out, logsumexp)


@dataclass
class CascadeBatch:
    """New tokens of several sequences whose contexts all start with `prefix_slots`; `rest` places
    the same new tokens over their contexts without that prefix."""

    prefix_slots: torch.Tensor  # [P]
    rest: AttentionBatch | PackedBatch
    prefix_start: int | None = field(init=False)  # the prefix is one run of slots starting here: read in place

    def __post_init__(self) -> None:
        self.prefix_start = run_start(self.prefix_slots)



def shared_prefix_blocks(block_tables: list[list[int]], block_size: int) -> int:
    """How many leading blocks every table shares; 0 when sharing them saves fewer than
    CASCADE_MIN_SAVED_TOKENS prefix reads. A block held by two sequences is never written: new
    tokens always land after it."""
    if len(block_tables) < 2:  # one sequence saves nothing (and decode of one takes this path every step)
        return 0
    n = 0
    for blocks in zip(*block_tables):
        if any(b != blocks[0] for b in blocks):
            break
        n += 1
    return n if n * block_size * (len(block_tables) - 1) >= CASCADE_MIN_SAVED_TOKENS else 0


def leading_run_blocks(block_table: list[int], full_blocks: int, block_size: int, decode: bool = False) -> int:
    """One sequence: how many of its first `full_blocks` blocks (those before its first new token)
    lie in one run of the pool, when attending to them apart from the rest pays off; 0 when the run
    is short, or for a `decode` step over a context wholly in one run (read in place in one pass)."""
    first = block_table[0] if block_table else 0
    n = 0
    while n < len(block_table) and block_table[n] == first + n:
        n += 1
    if decode and n == len(block_table):
        return 0
    n = min(n, full_blocks)
    return n if n * block_size >= SPLIT_MIN_RUN_TOKENS else 0


def cascade_attention(
    layer: int,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D] (already rotated)
    v: torch.Tensor,  # [T, Hkv, D]
    cache: PagedKVCache,
    batch: CascadeBatch,
) -> torch.Tensor:  # [T, H * D]
    T, heads, dim = q.shape
    rest_out, rest_lse = _attend_with_lse(layer, q, k, v, cache, batch.rest)  # [T, H, D], [T, H]
    k_cache, v_cache = cache.layer(layer)
    if batch.prefix_start is not None:  # views of the pool: no copy
        first, n = batch.prefix_start, batch.prefix_slots.numel()
        kp, vp = k_cache[first:first + n].transpose(0, 1)[None], v_cache[first:first + n].transpose(0, 1)[None]
    else:
        kp = k_cache.index_select(0, batch.prefix_slots).transpose(0, 1)[None]  # [1, Hkv, P, D]
        vp = v_cache.index_select(0, batch.prefix_slots).transpose(0, 1)[None]
    kernel = amx_kernel(q)
    if kernel is not None:  # every new token sees the whole prefix: offset = its length
        pre_out, pre_lse = amx_attention(kernel, q, kp[0].transpose(0, 1), vp[0].transpose(0, 1), kp.shape[2])
    else:
        kv_heads = kp.shape[1]
        group = heads // kv_heads
        qg = q.view(T, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * T, dim)
        out, lse = _flash(qg, kp, vp)  # [1, Hkv, G * T, D], [1, Hkv, G * T]: every new token sees the whole prefix
        pre_out = out.view(kv_heads, group, T, dim).permute(2, 0, 1, 3).reshape(T, heads, dim)
        pre_lse = lse.view(kv_heads, group, T).permute(2, 0, 1).reshape(T, heads)
    return merge_parts(pre_out, pre_lse, rest_out, rest_lse).reshape(T, heads * dim)


def _attend_with_lse(layer, q, k, v, cache, batch: AttentionBatch | PackedBatch):
    """Like `paged_attention`, also returning the log-sum-exp of each query's scores: ([T, H, D], [T, H])."""
    if isinstance(batch, PackedBatch):
        spans = zip(batch.parts, batch.offsets, batch.offsets[1:])
        outs, lses = zip(*[_attend_with_lse(layer, q[a:b], k[a:b], v[a:b], cache, part) for part, a, b in spans])
        return torch.cat(outs), torch.cat(lses)
    qh, kh, vh = write_and_gather(layer, q, k, v, cache, batch)  # [B, H, S, D], [B, Hkv, ctx, D]
    B, heads, S, dim = qh.shape
    kv_heads, ctx = kh.shape[1], kh.shape[2]
    group = heads // kv_heads
    allowed = batch.mask  # bool [B or 1, 1, S, ctx] or None
    if batch.is_causal:
        allowed = torch.ones(S, ctx, dtype=torch.bool).tril()[None, None]
    mask = None
    if allowed is not None:  # additive, in the query's dtype, repeated for the folded GQA groups
        mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf")).repeat(1, 1, group, 1)
    qg = qh.reshape(B, kv_heads, group * S, dim)  # query head h = kv head h // G, as in enable_gqa
    out, lse = _flash(qg, kh, vh, attn_mask=mask)  # [B, Hkv, G * S, D], [B, Hkv, G * S]
    out = out.view(B, kv_heads, group, S, dim).permute(0, 3, 1, 2, 4).reshape(B * S, heads, dim)
    lse = lse.view(B, kv_heads, group, S).permute(0, 3, 1, 2).reshape(B * S, heads)
    return out, lse


def decode_in_cascade(block_tables: list[list[int]], block_size: int, min_batch: int | None,
                      min_shared_reads: int = CASCADE_DECODE_MIN_SHARED_READS) -> bool:
    """Whether a decode step of sequences with these block tables goes to cascade attention rather
    than the decode kernel: `min_batch` or more of them (None: never) sharing a prefix whose tokens
    times the sequences reach `min_shared_reads`."""
    if min_batch is None or len(block_tables) < min_batch:
        return False
    shared = shared_prefix_blocks(block_tables, block_size) * block_size
    return shared > 0 and shared * len(block_tables) >= min_shared_reads
