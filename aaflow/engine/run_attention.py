"""Decode attention that reads K/V in place, run by run, as plain matrix products.

A run of consecutive slots is one contiguous [n, Hkv * D] matrix of the pool, so its scores for
all query heads come from one product against a block-diagonal query matrix (row (h, g) holds query
head h * G + g in kv head h's D columns, zeros elsewhere), and the output from one product of the
probabilities with V: both stream K and V once, in order, through oneDNN. The products do Hkv times
the useful FLOPs, which is free where decode is bound by memory, not arithmetic.

Why not the flash kernel: it reads each kv head of the pool's token-major rows with a stride,
and for a few query rows over long contexts it ran at 3.6-4.3 GB/s here, where these products ran
at 8.8 GB/s (SmolLM2, bf16, one token over 4,096 keys, 30 layers; AMD EPYC, AVX512-BF16). Nor is the
context gathered into one tensor first: the copy cost more than the attention.

The scores are rounded to the model's dtype before an fp32 softmax, as Hugging Face's eager
attention does; the engine uses this path for bf16 only, so fp32 results stay those of the flash
kernel. Sequences attend apart from each other here: no padding, no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aaflow.engine.cascade import shared_prefix_blocks
from aaflow.engine.kv_cache import PagedKVCache, slot_runs

# A run shorter than this is gathered with the sequence's other short runs into one piece: one
# product per short block would cost more in calls than its in-place read saves.
MIN_RUN_TOKENS = 64
# Below these (each context; all contexts together), gathering the batch for the flash kernel wins.
LONG_CONTEXT_TOKENS = 2048
MANY_CONTEXT_TOKENS = 32768


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
        pieces = [(k_cache[f:f + n].view(n, width), v_cache[f:f + n].view(n, width)) for f, n in self.runs]
        if self.gathered is not None:
            pieces.append((k_cache.index_select(0, self.gathered).view(-1, width),
                           v_cache.index_select(0, self.gathered).view(-1, width)))
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


def reads_in_place_pays(lengths: list[int], block_tables: list[list[int]], block_size: int) -> bool:
    """Whether a decode step over contexts of these lengths runs faster here than gathered into one
    padded batch for the flash kernel. Each sequence costs a few calls here, so short contexts lose;
    sequences that share leading blocks go to cascade attention, which reads those once. Measured
    (SmolLM2 bf16, tok/s here against gathered): 1 x 1k 0.98x, 1 x 4k 1.16x, 8 x 2k 0.60x, 8 x 4k
    1.17x, 32 x 1k 0.55x, 32 x 2k 1.54x, 32 x 4k 2.72x; 12 x 2.9k sharing 2.8k 0.45x (cascade wins)."""
    if len(lengths) == 1:
        return True
    if shared_prefix_blocks(block_tables, block_size):
        return False
    return min(lengths) >= LONG_CONTEXT_TOKENS and sum(lengths) >= MANY_CONTEXT_TOKENS


def block_diagonal_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q: [N, H, D] -> [Hkv * N * G, Hkv * D]: row (h, n, g) holds q[n, h * G + g] in kv head h's columns."""
    N, heads, dim = q.shape
    eye = torch.eye(num_kv_heads, dtype=q.dtype)
    qg = q.view(N, num_kv_heads, heads // num_kv_heads, dim)  # [N, Hkv, G, D]
    return torch.einsum("nhgd,hk->hngkd", qg, eye).reshape(-1, num_kv_heads * dim)


def attend_pieces(
    q: torch.Tensor,  # [N, H, D]: queries that all see every key of the pieces
    pieces: list[tuple[torch.Tensor, torch.Tensor]],  # (K, V) as [n_i, Hkv * D] matrices
    num_kv_heads: int,
) -> torch.Tensor:  # [N, H, D] in q's dtype
    """Softmax attention of the queries over the union of the pieces' keys."""
    N, heads, dim = q.shape
    group = heads // num_kv_heads
    qbd = block_diagonal_queries(q, num_kv_heads)  # [R, Hkv * D], R = Hkv * N * G
    scores = torch.cat([F.linear(qbd, k) for k, _ in pieces], dim=1).float() * dim ** -0.5  # [R, ctx]
    probs = torch.softmax(scores, dim=1).to(q.dtype)  # [R, ctx]
    out, start = None, 0
    for _, v in pieces:
        part = probs[:, start:start + v.shape[0]] @ v  # [R, Hkv * D]
        out = part if out is None else out + part
        start += v.shape[0]
    # keep kv head h's own columns for its rows: [Hkv, N * G, Hkv, D] -> [N * G, D, Hkv]
    own = out.view(num_kv_heads, N * group, num_kv_heads, dim).diagonal(dim1=0, dim2=2)
    return own.permute(2, 0, 1).reshape(num_kv_heads, N, group, dim).transpose(0, 1).reshape(N, heads, dim)


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
    outs = [attend_pieces(q[b:b + 1], ctx.read(k_cache, v_cache), kv_heads) for b, ctx in enumerate(batch.contexts)]
    return torch.cat(outs).reshape(q.shape[0], -1)  # [B, H, D] -> [B, H * D]
