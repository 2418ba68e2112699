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
from aaflow.engine.decode_kernel import KernelDecodeBatch, kernel_attention
from aaflow.engine.kv_cache import PagedKVCache

# The second attention pass and the merge pay off once the prefix reads they save (shared tokens x
# (sequences - 1)) reach this; below it, on SmolLM2 decode, cascade was slower than one pass over the
# whole context, and it wins by more the longer the prefix and the more sequences share it
# (docs/RESULTS-history.md).
CASCADE_MIN_SAVED_TOKENS = 1536
# One sequence whose context starts with a long run of consecutive blocks: attending to the run as
# views, without a mask, apart from the rest pays off from here on, against gathering the context
# or masking one call over it (docs/RESULTS-history.md). A decode step over a context in one run
# needs no mask and reads it in place in one pass, which beats the split.
SPLIT_MIN_RUN_TOKENS = 512
# With AMX, a decode step of this many sequences or more that share a prefix runs faster in cascade
# (the prefix attended once per kv head on AMX tiles for every sequence's query heads; each rest and
# the merge in the decode kernel) than in the kernel alone, whose AVX512-BF16 dot products read the
# prefix once per sequence; with fewer sequences the kernel is as fast or faster (step times, kernel
# against cascade: docs/RESULTS-history.md). On an AMD EPYC's AVX512-BF16 (no AMX: torch's flash
# for the prefix) the kernel won even at 12 sequences: cascade stays off there.
CASCADE_DECODE_MIN_BATCH = 8
# ... and once the shared prefix is long: its tokens x the sequences reach this; below it the kernel
# was as fast (same comparison).
CASCADE_DECODE_MIN_SHARED_READS = 8192

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns (out, logsumexp)


@dataclass
class CascadeBatch:
    """New tokens of several sequences whose contexts all start with `prefix_slots`; `rest` places
    the same new tokens over their contexts without that prefix."""

    prefix_slots: torch.Tensor  # [P]
    rest: AttentionBatch | PackedBatch | KernelDecodeBatch  # the kernel's: a decode step, merged in the kernel
    prefix_start: int | None = field(init=False)  # the prefix is one run of slots starting here: read in place

    def __post_init__(self) -> None:
        self.prefix_start = run_start(self.prefix_slots)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return cascade_attention(layer, q, k, v, cache, self)



def shared_prefix_blocks(block_tables: list[list[int]], block_size: int) -> int:
    """How many leading blocks every table shares; 0 when sharing them saves fewer than
    CASCADE_MIN_SAVED_TOKENS prefix reads. A block held by two sequences is never written: new
    tokens always land after it."""
    if len(block_tables) < 2:  # one sequence saves nothing (and decode of one takes this path every step)
        return 0
    n = common_blocks(block_tables)
    return n if n * block_size * (len(block_tables) - 1) >= CASCADE_MIN_SAVED_TOKENS else 0


def common_blocks(block_tables: list[list[int]]) -> int:
    """How many leading blocks every table shares."""
    n = 0
    for blocks in zip(*block_tables):
        if any(b != blocks[0] for b in blocks):
            break
        n += 1
    return n


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
    if isinstance(batch.rest, KernelDecodeBatch):  # the kernel attends the rest and merges the prefix's part
        cache.write(layer, batch.rest.write_slots, k, v)
        prefix = attend_prefix(q, cache.layer(layer), batch)
        return kernel_attention(q, *cache.layer(layer), batch.rest.reads, other=prefix)
    rest_out, rest_lse = attend_with_lse(layer, q, k, v, cache, batch.rest)  # [T, H, D], [T, H]
    pre_out, pre_lse = attend_prefix(q, cache.layer(layer), batch)
    return merge_parts(pre_out, pre_lse, rest_out, rest_lse).reshape(T, heads * dim)


def attend_prefix(q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], batch: CascadeBatch):
    """Every query over the whole shared prefix, GQA groups folded into the query axis (one pass
    over each kv head's keys for all its query heads): (out [T, H, D] bf16, lse [T, H] fp32)."""
    T, heads, dim = q.shape
    k_cache, v_cache = caches
    if batch.prefix_start is not None:  # views of the pool: no copy
        first, n = batch.prefix_start, batch.prefix_slots.numel()
        kp, vp = k_cache[first:first + n], v_cache[first:first + n]  # [P, Hkv, D]
    else:
        kp, vp = k_cache.index_select(0, batch.prefix_slots), v_cache.index_select(0, batch.prefix_slots)
    kv_heads = kp.shape[1]
    group = heads // kv_heads
    kernel = amx_kernel(q)
    if kernel is not None:  # rows t * G + g of kv head h are query head h * G + g; all see the whole prefix
        qg = q.view(T, kv_heads, group, dim).transpose(1, 2).reshape(T * group, kv_heads, dim)
        out, lse = amx_attention(kernel, qg, kp, vp, kp.shape[0])  # [T * G, Hkv, D], [T * G, Hkv]
        return (out.view(T, group, kv_heads, dim).transpose(1, 2).reshape(T, heads, dim),
                lse.reshape(T, group, kv_heads).transpose(1, 2).reshape(T, heads))
    qg = q.view(T, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * T, dim)
    out, lse = _flash(qg, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None])  # [1, Hkv, G * T, D], [1, Hkv, G * T]
    return (out.view(kv_heads, group, T, dim).permute(2, 0, 1, 3).reshape(T, heads, dim),
            lse.view(kv_heads, group, T).permute(2, 0, 1).reshape(T, heads))


def attend_with_lse(layer, q, k, v, cache, batch: AttentionBatch | PackedBatch):
    """Like `paged_attention`, also returning the log-sum-exp of each query's scores: ([T, H, D], [T, H])."""
    if isinstance(batch, PackedBatch):
        spans = zip(batch.parts, batch.offsets, batch.offsets[1:])
        outs, lses = zip(*[attend_with_lse(layer, q[a:b], k[a:b], v[a:b], cache, part) for part, a, b in spans])
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
