"""The physical bounds of the engine benchmark, from figures measured in the same run.

Decode reads every weight once per step (and each sequence's context KV): at best
(weight bytes + batch x context x KV bytes per token) / memcpy bandwidth seconds per step; the
issue's headline bound is the weights alone at batch 1. Prefill computes 2 FLOPs per matmul
parameter per token plus attention (4 x heads x head_dim FLOPs per key, half the keys on average
under the causal mask, per layer): at best the cores' measured matmul rate.
"""

from __future__ import annotations

import time

import torch

from aaflow.engine.dtypes import DTYPES


def matmul_flops_per_s(dtype: str, size: int = 2048, repeats: int = 5) -> float:
    """The cores' dense matmul rate in `dtype` (FLOP/s), the best of `repeats` after a warm-up: the
    practical peak that prefill's big matmuls can approach."""
    a = torch.randn(size, size).to(DTYPES[dtype])
    b = torch.randn(size, size).to(DTYPES[dtype])
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def bounds(engine, dtype: str, memcpy_bytes_per_s: float, prompt_lens: list[int], cells) -> dict:
    config = engine.config
    weight_bytes = engine.weight_nbytes
    kv_per_token = engine.kv_layout.token_nbytes
    # matmul parameters each prompt token goes through (the vocabulary head runs for the last one only)
    params = weight_bytes / DTYPES[dtype].itemsize - config.vocab_size * config.hidden_size
    peak = matmul_flops_per_s(dtype)

    def prefill_flops(n: int) -> float:  # per token, averaged over a prompt of n tokens
        attention = 4 * config.num_heads * config.head_dim * (n / 2) * config.num_layers
        return 2 * params + attention

    return {
        "memcpy_bytes_per_s": memcpy_bytes_per_s, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
        "matmul_flops_per_s": peak,
        "decode_b1_weights_tok_per_s": memcpy_bytes_per_s / weight_bytes,
        "decode_tok_per_s": {f"{c}x{b}": b * memcpy_bytes_per_s / (weight_bytes + b * c * kv_per_token)
                             for c, b in cells},
        "prefill_tok_per_s": {str(n): peak / prefill_flops(n) for n in prompt_lens},
    }
