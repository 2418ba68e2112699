"""Decode attention for a batch whose sequences fall into groups that share leading blocks.

A serving batch mixes many workflows: the agents reading one document share its cached blocks
(prefix cache or fork), agents reading another share those; no prefix is shared by the whole batch,
so plain cascade (`cascade.py`) does not apply and each sequence would read its document's K/V on
its own. Here each group's shared prefix is attended once, for all its members' queries (GQA
groups folded into the query axis: one product per kv head instead of one per sequence), each
sequence's remainder (its own blocks and new token) is attended apart, and the two merge exactly
through their log-sum-exps. K/V reads of a step fall from the sum of every context to each
document once plus each sequence's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.engine.amx_attention import merge_parts
from aaflow.engine.attention import AttentionBatch
from aaflow.engine.cascade import (CASCADE_MIN_SAVED_TOKENS, CascadeBatch, attend_prefix, attend_with_lse,
                                   common_blocks)
from aaflow.engine.decode_kernel import KernelDecodeBatch, KernelReads, kernel_attention
from aaflow.engine.kv_cache import PagedKVCache


@dataclass
class PrefixGroup:
    """Rows of a decode batch whose contexts all begin with `prefix_slots`."""

    rows: torch.Tensor  # [m] int64 row indices into the batch
    prefix: CascadeBatch  # its `prefix_slots` [P] (read in place when one run); its rest unused


@dataclass
class GroupedCascadeBatch:
    """A decode step: `groups` attend their shared prefixes once; `rest` places every sequence's new
    token over its context past its group's prefix (the whole context for a sequence in no group),
    through torch's paths or read in place by the decode kernel, which also merges the groups' parts."""

    groups: list[PrefixGroup]
    rest: AttentionBatch | KernelDecodeBatch

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return grouped_cascade_attention(layer, q, k, v, cache, self)


def prefix_groups(block_tables: list[list[int]], block_size: int) -> list[tuple[list[int], int]]:
    """(rows, shared leading blocks) of the groups of sequences whose shared prefixes, each attended
    once, save the most K/V reads: sequences that begin with the same block form a group, split
    further by the block after their common prefix (a chat header shared by all, then one group per
    document) where the parts save more; a group must save CASCADE_MIN_SAVED_TOKENS reads. []
    when the whole batch is one group (plain cascade serves it) or none pays."""
    groups = _best_groups(block_tables, list(range(len(block_tables))), 0, block_size)
    return [] if len(groups) == 1 and len(groups[0][0]) == len(block_tables) else groups


def _best_groups(tables: list[list[int]], rows: list[int], depth: int, block_size: int) -> list[tuple[list[int], int]]:
    """The best grouping of `rows`, which share their first `depth` blocks, by the block at `depth`."""
    by_block: dict[int, list[int]] = {}
    for r in rows:
        if len(tables[r]) > depth + 1:  # a block still written (the last) is never shared
            by_block.setdefault(tables[r][depth], []).append(r)
    out = []
    for members in by_block.values():
        if len(members) < 2:
            continue
        n = min(common_blocks([tables[r] for r in members]), min(len(tables[r]) for r in members) - 1)
        whole = [(members, n)] if n * block_size * (len(members) - 1) >= CASCADE_MIN_SAVED_TOKENS else []
        parts = _best_groups(tables, members, n, block_size)
        out += parts if _saved(parts) > _saved(whole) else whole
    return out


def _saved(groups: list[tuple[list[int], int]]) -> int:
    """Blocks of K/V reads the groups save: each prefix read once instead of once per member."""
    return sum(n * (len(rows) - 1) for rows, n in groups)


def build(write: torch.Tensor, contexts: list[torch.Tensor], groups: list[tuple[list[int], int]],
          block_size: int, kernel: bool = False) -> GroupedCascadeBatch:
    """write [B] the new tokens' slots; contexts[b] [len_b] slots, its new token's included; `kernel`:
    the remainders go to the decode kernel."""
    skip = [0] * len(contexts)
    parts = []
    for rows, blocks in groups:
        shared = blocks * block_size
        for r in rows:
            skip[r] = shared
        prefix = CascadeBatch(contexts[rows[0]][:shared], None)
        parts.append(PrefixGroup(torch.tensor(rows, dtype=torch.long), prefix))
    rests = [c[s:] for c, s in zip(contexts, skip)]
    rest = KernelDecodeBatch(write, KernelReads.of(rests)) if kernel else AttentionBatch.decode(write, rests)
    return GroupedCascadeBatch(parts, rest)


def grouped_cascade_attention(
    layer: int,
    q: torch.Tensor,  # [B, H, D]: one new token per sequence
    k: torch.Tensor,  # [B, Hkv, D] (already rotated)
    v: torch.Tensor,  # [B, Hkv, D]
    cache: PagedKVCache,
    batch: GroupedCascadeBatch,
) -> torch.Tensor:  # [B, H * D]
    if isinstance(batch.rest, KernelDecodeBatch):
        return _kernel_rests(layer, q, k, v, cache, batch)
    B, heads, dim = q.shape
    out, lse = attend_with_lse(layer, q, k, v, cache, batch.rest)  # [B, H, D], [B, H]; writes the new K/V
    for group in batch.groups:
        pre_out, pre_lse = attend_prefix(q[group.rows], cache.layer(layer), group.prefix)  # [m, H, D], [m, H]
        out[group.rows] = merge_parts(pre_out, pre_lse, out[group.rows], lse[group.rows])
    return out.reshape(B, heads * dim)


def _kernel_rests(layer: int, q, k, v, cache: PagedKVCache, batch: GroupedCascadeBatch) -> torch.Tensor:
    """The groups' prefixes first, then the kernel over every remainder, merging each row's prefix
    part in the same pass (a row in no group brings an empty part: log-sum-exp -inf)."""
    B, heads, dim = q.shape
    cache.write(layer, batch.rest.write_slots, k, v)
    pre_out = q.new_zeros(B, heads, dim)  # [B, H, D]
    pre_lse = torch.full((B, heads), float("-inf"))  # [B, H]
    for group in batch.groups:
        part_out, part_lse = attend_prefix(q[group.rows], cache.layer(layer), group.prefix)  # [m, H, D], [m, H]
        pre_out[group.rows] = part_out.to(q.dtype)
        pre_lse[group.rows] = part_lse.float()
    return kernel_attention(q, *cache.layer(layer), batch.rest.reads, (pre_out, pre_lse))  # [B, H * D]
