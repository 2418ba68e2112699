"""Decode attention in bf16 as plain matrix products, over K/V read in place or gathered.

A run of consecutive slots is one contiguous [n, Hkv * D] matrix of the pool, so its scores for
all query heads come from one product against a block-diagonal query matrix (row (h, g) holds query
head h * G + g in kv head h's D columns, zeros elsewhere), and the output from one product of the
probabilities with V: both stream K and V once, in order, through oneDNN. The products do Hkv times
the useful FLOPs, which is free where decode is bound by memory, not arithmetic.

Two ways to feed them:
- `RunsDecodeBatch`: each sequence reads its long runs in place (one sequence, or many long
  contexts). Why not the flash kernel: it reads each kv head of the pool's token-major rows with a
  stride, and for a few query rows over long contexts these products stream K and V much faster
  (docs/RESULTS-history.md). The query matrix is built once per batch, not per sequence.
- `GatheredDecodeBatch`: many short contexts are gathered into one padded batch for two batched
  products (bmm), padding masked; faster than the flash kernel over the same gather at 16-32 x 1k
  and 8 x 2k, level with it at 4-8 x 1k (docs/RESULTS-history.md).

The scores are rounded to the model's dtype before an fp32 softmax, as Hugging Face's eager
attention does; the engine uses these paths for bf16 only, so fp32 results stay those of the flash
kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aaflow.engine.attention import AttentionBatch, write_and_gather
from aaflow.engine.cascade import shared_prefix_blocks
from aaflow.engine.kv_cache import PagedKVCache, slot_runs

# A run shorter than this is gathered with the sequence's other short runs into one piece: one
# product per short block would cost more in calls than its in-place read saves.
MIN_RUN_TOKENS = 64
# Below these (each context; all contexts together), gathering the batch for batched products wins,
# up to GATHER_MAX_TOKENS in all: beyond, the gathered copy (50 MB a layer for SmolLM2) costs more.
LONG_CONTEXT_TOKENS = 4096
MANY_CONTEXT_TOKENS = 32768
GATHER_MAX_TOKENS = 65536


@dataclass
class ContextPieces:
    """A sequence's context as pieces attention reads: long runs of slots in place, plus every
    other slot gathered into one piece. Softmax over the union does not depend on their order."""

    runs: list[tuple[int, int]]  # (first slot, length) of each long run
    gathered: torch.Tensor | None  # [m] slots of the short runs, or None

    @classmethod
    def of(cls, slots: torch.Tensor) -> "ContextPieces":  # slots: [ctx]
        runs, short = [], []
        for offset, first, n in slot_runs(slots):
            if n >= MIN_RUN_TOKENS:
                runs.append((first, n))
            else:
                short.append(slots[offset:offset + n])
        return cls(runs, torch.cat(short) if short else None)

    def read(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """k_cache, v_cache: [slots, Hkv, D] -> (K, V) of each piece as [n, Hkv * D] matrices."""
        width = k_cache.shape[1] * k_cache.shape[2]
        k_flat, v_flat = k_cache.view(-1, width), v_cache.view(-1, width)
        pieces = [(k_flat[f:f + n], v_flat[f:f + n]) for f, n in self.runs]
        if self.gathered is not None:
            pieces.append((k_flat.index_select(0, self.gathered), v_flat.index_select(0, self.gathered)))
        return pieces


@dataclass
class RunsDecodeBatch:
    """One new token for each of `batch` sequences; each attends over its own context pieces
    (its new token's slot included)."""

    write_slots: torch.Tensor  # [B]
    contexts: list[ContextPieces]  # [B]

    @classmethod
    def build(cls, write_slots: torch.Tensor, contexts: list[torch.Tensor]) -> "RunsDecodeBatch":
        """contexts[b]: [len_b] slots of sequence b's context, its new token's included."""
        return cls(write_slots, [ContextPieces.of(c) for c in contexts])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return runs_decode_attention(layer, q, k, v, cache, self)


@dataclass
class GatheredDecodeBatch:
    """One new token for each of `batch` sequences, whose contexts are gathered into one padded
    batch (the flash path's `AttentionBatch.decode`): where in-place reads do not pay (many short
    contexts), two batched products over the gathered keys beat the flash kernel, which runs one-row
    products for them."""

    decode: AttentionBatch  # write slots, padded read slots [B, ctx], mask [B, 1, 1, ctx] or None
    padding: torch.Tensor | None  # [B, 1, ctx] bool: True for a padding key; None when all are full

    @classmethod
    def build(cls, write_slots: torch.Tensor, contexts: list[torch.Tensor]) -> "GatheredDecodeBatch":
        """contexts[b]: [len_b] slots of sequence b's context, its new token's included."""
        decode = AttentionBatch.decode(write_slots, contexts)
        return cls(decode, None if decode.mask is None else ~decode.mask[:, 0])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return gathered_decode_attention(layer, q, k, v, cache, self)


def reads_in_place_pays(lengths: list[int], block_tables: list[list[int]], block_size: int) -> bool:
    """Whether a decode step over contexts of these lengths runs faster here than gathered into one
    padded batch (`GatheredDecodeBatch`). Each sequence costs a few calls here, so short contexts
    lose; sequences that share leading blocks go to cascade attention, which reads those once.
    Against gathered, a step here lost over 2k-token contexts and won from 4k, by far at 32 x 4k;
    over a shared prefix cascade won (docs/RESULTS-history.md)."""
    if len(lengths) == 1:
        return True
    if shared_prefix_blocks(block_tables, block_size):
        return False
    total = sum(lengths)
    return total > GATHER_MAX_TOKENS or (min(lengths) >= LONG_CONTEXT_TOKENS and total >= MANY_CONTEXT_TOKENS)


def block_diagonal_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q: [N, H, D] -> [N, Hkv * G, Hkv * D]: row (h, g) of query n holds q[n, h * G + g] in kv head h's columns."""
    N, heads, dim = q.shape
    eye = torch.eye(num_kv_heads, dtype=q.dtype)
    qg = q.view(N, num_kv_heads, heads // num_kv_heads, dim)  # [N, Hkv, G, D]
    return torch.einsum("nhgd,hk->nhgkd", qg, eye).reshape(N, heads, num_kv_heads * dim)


def scaled_block_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`block_diagonal_queries` of q / sqrt(D): the scale folded into the queries is exact where it
    is a power of two (D = 64, 256), so the scores round as scaled products would."""
    return block_diagonal_queries(q * q.shape[-1] ** -0.5, num_kv_heads)


def own_heads(out: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """out: [N, Hkv * G, Hkv * D] products with block-diagonal queries -> [N, H * D]: each row's own kv head."""
    N, heads, width = out.shape
    dim = width // num_kv_heads
    own = out.view(N, num_kv_heads, heads // num_kv_heads, num_kv_heads, dim).diagonal(dim1=1, dim2=3)  # [N, G, D, Hkv]
    return own.permute(0, 3, 1, 2).reshape(N, heads * dim)


def attend_pieces(
    qbd: torch.Tensor,  # [R, Hkv * D] block-diagonal queries, already scaled by 1 / sqrt(D)
    pieces: list[tuple[torch.Tensor, torch.Tensor]],  # (K, V) as [n_i, Hkv * D] matrices
    out: torch.Tensor,  # [R, Hkv * D], written
) -> None:
    """Softmax attention of the rows over the union of the pieces' keys, into `out`."""
    scores = torch.cat([F.linear(qbd, k) for k, _ in pieces], dim=1) if len(pieces) > 1 else F.linear(qbd, pieces[0][0])
    probs = torch.softmax(scores, dim=1)  # [R, ctx]; reduced dtypes are summed in fp32
    start = 0
    for i, (_, v) in enumerate(pieces):
        part = probs[:, start:start + v.shape[0]]
        torch.mm(part, v, out=out) if i == 0 else out.addmm_(part, v)
        start += v.shape[0]


def gathered_decode_attention(
    layer: int,
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, Hkv, D] (already rotated)
    v: torch.Tensor,  # [B, Hkv, D]
    cache: PagedKVCache,
    batch: GatheredDecodeBatch,
) -> torch.Tensor:  # [B, H * D]
    _, kh, vh = write_and_gather(layer, q, k, v, cache, batch.decode)  # kh, vh: [B, Hkv, ctx, D]
    B, kv_heads, ctx, dim = kh.shape
    keys = kh.transpose(1, 2).reshape(B, ctx, kv_heads * dim)  # the gathered rows, as they lie: a view
    values = vh.transpose(1, 2).reshape(B, ctx, kv_heads * dim)
    qbd = scaled_block_queries(q, kv_heads)  # [B, H, Hkv * D]
    scores = torch.bmm(qbd, keys.transpose(1, 2))  # [B, H, ctx]
    if batch.padding is not None:
        scores.masked_fill_(batch.padding, float("-inf"))
    probs = torch.softmax(scores, dim=2)  # reduced dtypes are summed in fp32
    return own_heads(torch.bmm(probs, values), kv_heads)  # [B, H, Hkv * D] -> [B, H * D]


def runs_decode_attention(
    layer: int,
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, Hkv, D] (already rotated)
    v: torch.Tensor,  # [B, Hkv, D]
    cache: PagedKVCache,
    batch: RunsDecodeBatch,
) -> torch.Tensor:  # [B, H * D]
    cache.write(layer, batch.write_slots, k, v)
    k_cache, v_cache = cache.layer(layer)
    kv_heads = k.shape[1]
    qbd = scaled_block_queries(q, kv_heads)  # [B, H, Hkv * D]
    out = torch.empty_like(qbd)
    for b, ctx in enumerate(batch.contexts):
        attend_pieces(qbd[b], ctx.read(k_cache, v_cache), out[b])
    return own_heads(out, kv_heads)
