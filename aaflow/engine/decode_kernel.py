"""Decode attention in bf16 or fp32 through a compiled kernel (`csrc/decode_attention.cpp`) that reads
each sequence's K/V in place from the paged pool, by slot, on all of torch's intra-op threads.

fp32 (CPUs without native bf16, where the engine runs fp32): torch's paths gather every context
into a copy, then attend it; the kernel's AVX2 loops (`csrc/decode_fp32.h`) read it in place
(docs/RESULTS.md, "fp32 attention read in place", has the figures).

Why a kernel: torch's products over K/V read in place (`run_attention`) stream far below a plain
copy, because oneDNN's small-M bf16 GEMM repacks its operand each call and does not split a long
reduction across cores; the flash kernel reads each kv head with a stride, slower still. The
kernel splits every context into fixed chunks of keys across the cores and feeds bf16 pairs straight
into AVX512-BF16 dot products, and beats the in-place products per layer (docs/RESULTS.md, "decode
attention in bf16 runs in a compiled kernel"). One pass per chunk (scores in fp32, softmax, the
probabilities rounded to bf16 for the V sum, as flash rounds them), the chunks merged in order
through their maxima and sums, replaced two passes with torch's softmax between them (a shorter
decode step: docs/RESULTS-history.md). Chunks sit at fixed key positions, so a sequence's result
does not depend on the batch it runs in. The chunks over the same keys (the readers of one cached
document in a serving batch) run one after the other on one thread, so that all but the first read
the chunk's K and V from cache rather than memory; the order changes no result. Given a part over
other keys (its output and log-sum-exp: cascade's shared prefix), the kernel merges it in the same
pass.

The kernel is compiled on first use with the machine's compiler (torch's cpp_extension, about 30 s,
cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions). Without a compiler, or with
AAFLOW_DECODE_KERNEL=0, the engine keeps its torch paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.engine.attention import pad_slots
from aaflow.engine.kv_cache import PagedKVCache
from aaflow.engine.native_build import NativeModule

HEAD_DIMS = (64, 128)  # the head dims the kernel is built for
DTYPES = (torch.bfloat16, torch.float32)
ENV_SWITCH = "AAFLOW_DECODE_KERNEL"
_NATIVE = NativeModule("decode_attention.cpp", "the decode attention kernel", ENV_SWITCH)


def load():
    """The compiled kernel module, building it on first call; None where it cannot be built or is
    switched off (AAFLOW_DECODE_KERNEL=0)."""
    return _NATIVE.load()


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decode for a model of this dtype and head dim goes through the kernel (building it now)."""
    return dtype in DTYPES and head_dim in HEAD_DIMS and load() is not None


@dataclass
class KernelReads:
    """Query rows that each attend over their own list of slots (a row's new token's included)."""

    slots: torch.Tensor  # [N, ctx] int64, each row padded past its length
    lengths: torch.Tensor  # [N] int64

    @classmethod
    def of(cls, contexts: list[torch.Tensor]) -> "KernelReads":
        """contexts[n]: [len_n] slots that row n attends over."""
        return cls(pad_slots(contexts), torch.tensor([c.numel() for c in contexts], dtype=torch.long))


@dataclass
class KernelDecodeBatch:
    """One new token for each of `batch` sequences, each attending over its context read in place."""

    write_slots: torch.Tensor  # [B]
    reads: KernelReads  # one row per sequence

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        return kernel_decode_attention(layer, q, k, v, cache, self)


def kernel_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D], every row's keys already written
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    reads: KernelReads,
    other: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([N, H, D] q's dtype, [N, H] fp32)
) -> torch.Tensor:  # [N, H * D]
    """Softmax attention of each query row over its slots; with `other` (the output and log-sum-exp
    of the same rows over a disjoint set of keys, e.g. a shared prefix) over the union of both."""
    scaled = (q * q.shape[-1] ** -0.5).contiguous()  # exact for D = 64, 256: scores round as scaled products
    pre_out, pre_lse = (None, None) if other is None else (other[0].contiguous(), other[1].float().contiguous())
    out, _ = load().decode_attention(scaled, k_cache, v_cache, reads.slots, reads.lengths, pre_out, pre_lse)
    return out.view(q.shape[0], -1)


def kernel_decode_attention(
    layer: int,
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, Hkv, D] (already rotated)
    v: torch.Tensor,  # [B, Hkv, D]
    cache: PagedKVCache,
    batch: KernelDecodeBatch,
) -> torch.Tensor:  # [B, H * D]
    cache.write(layer, batch.write_slots, k, v)
    return kernel_attention(q, *cache.layer(layer), batch.reads)
