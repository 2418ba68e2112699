"""Attention over the paged KV cache: write the new K/V to their slots, attend over the context."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aaflow.engine.kv_cache import PagedKVCache


@dataclass
class AttentionBatch:
    """What every layer needs to place and read K/V for one forward pass.

    The pass computes `batch * q_len` new tokens: one sequence's chunk (prefill, batch=1) or
    one token for each of `batch` sequences (decode, q_len=1).
    """

    batch: int
    q_len: int
    write_slots: torch.Tensor  # [batch * q_len] where each new token's K/V goes
    read_slots: torch.Tensor | None  # [batch, ctx_len] slots of each full context; None: only the new tokens
    mask: torch.Tensor | None  # bool [batch, 1, q_len, ctx_len], True = may attend; None = see is_causal
    is_causal: bool  # plain causal attention among the new tokens (a fresh prefill)
    read_start: int | None = None  # batch 1 whose context is one run of slots: it starts here (read in place)

    @classmethod
    def prefill(cls, write_slots: torch.Tensor, context_slots: torch.Tensor, start: int) -> "AttentionBatch":
        """One sequence: new tokens at positions [start, start + T) over context slots [start + T]."""
        q_len = write_slots.numel()
        if start == 0:
            return cls(1, q_len, write_slots, None, None, True)
        ctx = context_slots.numel()
        # query i (position start + i) sees keys 0..start + i
        mask = torch.arange(ctx)[None, :] <= (start + torch.arange(q_len))[:, None]  # [T, ctx]
        return cls(1, q_len, write_slots, context_slots[None, :], mask[None, None], False, run_start(context_slots))

    @classmethod
    def prefill_batch(cls, write_slots: list[torch.Tensor], contexts: list[torch.Tensor],
                      starts: list[int]) -> "AttentionBatch":
        """Several sequences' chunks of one length S, each continuing its context: chunk b's tokens
        sit at positions [starts[b], starts[b] + S) over context slots contexts[b] ([starts[b] + S])."""
        q_len = write_slots[0].numel()
        padded = pad_slots(contexts)  # [B, ctx]
        ctx = padded.shape[1]
        last_key = torch.tensor(starts)[:, None] + torch.arange(q_len)[None, :]  # [B, S]: query i sees keys <= it
        mask = torch.arange(ctx)[None, None, :] <= last_key[:, :, None]  # [B, S, ctx]; padding lies beyond
        return cls(len(contexts), q_len, torch.cat(write_slots), padded, mask[:, None], False)

    @classmethod
    def decode(cls, write_slots: torch.Tensor, context_slots: list[torch.Tensor]) -> "AttentionBatch":
        """One new token per sequence; context_slots[b]: [len_b] including the new token."""
        lengths = torch.tensor([c.numel() for c in context_slots])
        padded = pad_slots(context_slots)  # [B, ctx]
        ctx = padded.shape[1]
        mask = None
        if bool((lengths != ctx).any()):
            mask = (torch.arange(ctx)[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, ctx]
        read_start = run_start(context_slots[0]) if len(context_slots) == 1 else None
        return cls(len(context_slots), 1, write_slots, padded, mask, False, read_start)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return paged_attention(layer, q, k, v, cache, self)


def run_start(slots: torch.Tensor) -> int | None:
    """slots: [ctx] -> the first slot if they are consecutive (a fresh or imported sequence's blocks
    usually are), else None: attention then reads K/V as views of the pool instead of gathering."""
    first = int(slots[0])
    if int(slots[-1]) - first != slots.numel() - 1 or not bool((slots[1:] - slots[:-1] == 1).all()):
        return None
    return first


def pad_slots(contexts: list[torch.Tensor], length: int | None = None) -> torch.Tensor:
    """Each sequence's context slots in one row, padded with slot 0 (callers mask it out) to `length`,
    by default the longest context's."""
    length = length or max(c.numel() for c in contexts)
    padded = torch.zeros(len(contexts), length, dtype=torch.long)  # [B, length]
    for b, slots in enumerate(contexts):
        padded[b, : slots.numel()] = slots
    return padded


@dataclass
class PackedBatch:
    """Several sequences' prefill chunks packed along the token axis, so that one forward pass reads
    the weights once for all of them; attention runs per sequence. parts[i] covers the new tokens
    [offsets[i], offsets[i + 1])."""

    parts: list[AttentionBatch]
    offsets: list[int]  # [len(parts) + 1]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return paged_attention(layer, q, k, v, cache, self)


def prefill_parts(chunks: list[tuple[torch.Tensor, torch.Tensor, int]]) -> AttentionBatch | PackedBatch:
    """The attention batch of a packed prefill. `chunks[i]` = (write slots [S_i], context slots
    [start_i + S_i], start_i) of one sequence's new tokens, in token order. Consecutive chunks of one
    length that continue a context attend in one batched call; the others one by one."""
    parts, offsets, i = [], [0], 0
    while i < len(chunks):
        j = i + 1
        if chunks[i][2] > 0:
            while j < len(chunks) and chunks[j][2] > 0 and chunks[j][0].numel() == chunks[i][0].numel():
                j += 1
        run = chunks[i:j]
        parts.append(AttentionBatch.prefill(*run[0]) if len(run) == 1 else
                     AttentionBatch.prefill_batch(*(list(x) for x in zip(*run))))
        offsets.append(offsets[-1] + sum(c[0].numel() for c in run))
        i = j
    return parts[0] if len(parts) == 1 else PackedBatch(parts, offsets)


def paged_attention(
    layer: int,
    q: torch.Tensor,  # [T, H, D], T = batch * q_len
    k: torch.Tensor,  # [T, Hkv, D] (already rotated)
    v: torch.Tensor,  # [T, Hkv, D]
    cache: PagedKVCache,
    batch: AttentionBatch | PackedBatch,
) -> torch.Tensor:  # [T, H * D]
    """Attend the new tokens over their contexts. A decode step folds each kv head's query group
    into the query axis instead of `enable_gqa`: the same result (to the last bit in bf16, within
    an ulp in fp32), and the CPU flash kernel then runs one product per kv head, not one one-row
    product per query head, much faster in bf16 and somewhat in fp32. Longer chunks keep
    `enable_gqa`: there folding did not pay (docs/RESULTS-history.md, "A third CPU kind")."""
    if isinstance(batch, PackedBatch):
        spans = zip(batch.parts, batch.offsets, batch.offsets[1:])
        return torch.cat([paged_attention(layer, q[a:b], k[a:b], v[a:b], cache, part) for part, a, b in spans])
    qh, kh, vh = write_and_gather(layer, q, k, v, cache, batch)
    if batch.q_len == 1:  # decode: each kv head's query group as rows of one product
        B, heads, _, dim = qh.shape
        qg = qh.reshape(B, kh.shape[1], -1, dim)  # [B, Hkv, G, D]: query head h reads kv head h // G
        out = F.scaled_dot_product_attention(qg, kh, vh, attn_mask=batch.mask)  # mask [B, 1, 1, ctx] or None
        return out.reshape(q.shape[0], -1)  # [B, Hkv, G, D] = [B, H * D]
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=batch.mask, is_causal=batch.is_causal, enable_gqa=True
    )  # [B, H, S, D]
    return out.transpose(1, 2).reshape(q.shape[0], -1)


def write_and_gather(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, batch: AttentionBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # qh [B, H, S, D]; kh, vh [B, Hkv, ctx, D]
    """Store the new tokens' K/V at their slots and read back each sequence's context."""
    cache.write(layer, batch.write_slots, k, v)
    B, S = batch.batch, batch.q_len
    heads, dim = q.shape[1], q.shape[2]
    qh = q.view(B, S, heads, dim).transpose(1, 2)  # [B, H, S, D]
    if batch.read_slots is None:
        kh = k.view(B, S, -1, dim).transpose(1, 2)  # [B, Hkv, S, D]
        vh = v.view(B, S, -1, dim).transpose(1, 2)
    elif batch.read_start is not None:  # one run of slots: views of the pool, no copy
        k_cache, v_cache = cache.layer(layer)
        ctx, first = batch.read_slots.shape[1], batch.read_start
        kh = k_cache[first:first + ctx].view(1, ctx, -1, dim).transpose(1, 2)  # [1, Hkv, ctx, D]
        vh = v_cache[first:first + ctx].view(1, ctx, -1, dim).transpose(1, 2)
    else:
        k_cache, v_cache = cache.layer(layer)
        flat = batch.read_slots.reshape(-1)
        ctx = batch.read_slots.shape[1]
        kh = k_cache.index_select(0, flat).view(B, ctx, -1, dim).transpose(1, 2)  # [B, Hkv, ctx, D]
        vh = v_cache.index_select(0, flat).view(B, ctx, -1, dim).transpose(1, 2)
    return qh, kh, vh
