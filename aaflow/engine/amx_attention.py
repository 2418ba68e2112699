"""Causal bf16 prefill attention on AMX tiles (`csrc/amx_attention.cpp`), where the CPU has AMX.

Why: with SmolLM2's 64-dim heads a prefill's attention is bound by the softmax, not the products;
with torch's CPU flash kernel, attention took most of a long prefill's time (docs/RESULTS-history.md).
This kernel keeps each block's scores in fp32 on the tiles and in AVX512, runs exp as a short
polynomial, and skips every block past a row's last visible key; one call covers a chunk over any
earlier context (no masked triangle, no split into two calls). Probabilities are rounded to bf16
before the product with V, as flash rounds them. `AAFLOW_AMX_ATTENTION=0` keeps torch's flash.
"""

from __future__ import annotations

import functools

import torch

from aaflow.engine.native_build import NativeModule
from aaflow.common.machine import matrix_isa

HEAD_DIM = 64  # the kernel's one head size (SmolLM2's); other models keep torch's flash

AMX = NativeModule("amx_attention.cpp", "the AMX prefill attention kernel", "AAFLOW_AMX_ATTENTION",
                   extra_cflags=("-mamx-tile", "-mamx-bf16"))


def amx_kernel(q: torch.Tensor):
    """The compiled kernel when it can attend these queries here (bf16, 64-dim heads, an AMX CPU),
    else None."""
    if q.dtype != torch.bfloat16 or q.shape[-1] != HEAD_DIM or matrix_isa() != "amx":
        return None
    module = AMX.load()
    return module if module is not None and _granted(module) else None


@functools.cache
def _granted(module) -> bool:
    """Linux hands out AMX state per process, on request; refused, the engine keeps torch's flash."""
    return bool(module.ready())


def amx_attention(
    kernel,
    q: torch.Tensor,  # [T, H, 64]: query t sees keys j <= t + offset
    k: torch.Tensor,  # [S, Hkv, 64] (any row stride, heads contiguous)
    v: torch.Tensor,  # [S, Hkv, 64]
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, H, 64] bf16, lse [T, H] fp32)
    """Attention of each query over its visible keys (offset >= S - 1: all of them), and each row's
    log-sum-exp of its scaled scores, to merge with a part over other keys (`merge_parts`)."""
    q, k, v = (x if x.stride(2) == 1 and x.stride(1) == HEAD_DIM else x.contiguous() for x in (q, k, v))
    out, lse = kernel.attention(q, k, v, int(offset), q.shape[-1] ** -0.5)  # [T, H, 64], [H, T]
    return out, lse.t()


def merge_parts(
    out_a: torch.Tensor, lse_a: torch.Tensor,  # [..., D], [...] (e.g. [T, H]): attention over one set of keys
    out_b: torch.Tensor, lse_b: torch.Tensor,  # the same queries over a disjoint set
) -> torch.Tensor:  # [..., D] in out_a's dtype: attention over the union (a softmax over both sets)
    """Two partial attentions merged exactly through their log-sum-exps."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = (lse_a - top).exp()[..., None], (lse_b - top).exp()[..., None]  # [..., 1]
    return ((out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)).to(out_a.dtype)
