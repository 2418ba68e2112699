"""Break-even what-ifs: when moving KV beats recomputing it (bytes/s, tokens, ratios)."""

from __future__ import annotations

from aaflow.common.errors import CostModelError
from aaflow.costmodel.hardware import ComputeProfile, LinkProfile
from aaflow.costmodel.model_profile import ModelProfile


def break_even_bandwidth(model: ModelProfile, compute: ComputeProfile, context_tokens: int = 4096) -> float:
    """Bandwidth (bytes/s) at which sending the KV of `context_tokens` takes as long as prefilling them:
    kv_bytes_per_token * context_tokens / prefill_time(context_tokens). Link latency is ignored."""
    if context_tokens <= 0:
        raise CostModelError(f"context_tokens must be positive, got {context_tokens!r}")
    return model.kv_bytes_per_token * context_tokens / compute.prefill_time(context_tokens)


def break_even_bandwidth_flops(model: ModelProfile, peak_flops: float, mfu: float = 1.0) -> float:
    """The design's first-order break-even (bytes/s): kv_bytes_per_token / prefill time per token, with a
    token costing flops_per_token / (peak_flops * mfu). Llama-3-8B bf16 at 312e12 FLOP/s: ~2.55e9 B/s
    (~20.4 Gbps)."""
    if peak_flops <= 0 or not 0 < mfu <= 1:
        raise CostModelError(f"need peak_flops > 0 and mfu in (0, 1], got {peak_flops!r}, {mfu!r}")
    return model.kv_bytes_per_token / (model.flops_per_token / (peak_flops * mfu))


def _gain(model: ModelProfile, compute: ComputeProfile, link: LinkProfile, tokens: int) -> float:
    """Prefill time minus transfer time of `tokens` (positive: transfer is cheaper)."""
    return compute.prefill_time(tokens) - link.transfer_time(tokens * model.kv_bytes_per_token)


def break_even_context(model: ModelProfile, compute: ComputeProfile, link: LinkProfile,
                       max_tokens: int = 131072) -> int | None:
    """Smallest context length (tokens, 1..max_tokens) whose KV transfers faster than it prefills; None if
    there is none. The gain is a convex quadratic in the length, so once it is <= 0 it changes sign at most
    once more: bisection from 1 is exact."""
    if max_tokens < 1:
        raise CostModelError(f"max_tokens must be >= 1, got {max_tokens!r}")
    if _gain(model, compute, link, 1) > 0:
        return 1
    if _gain(model, compute, link, max_tokens) <= 0:
        return None
    low, high = 1, max_tokens  # gain(low) <= 0 < gain(high)
    while high - low > 1:
        mid = (low + high) // 2
        if _gain(model, compute, link, mid) > 0:
            high = mid
        else:
            low = mid
    return high


def transfer_speedup(model: ModelProfile, compute: ComputeProfile, link: LinkProfile, context_tokens: int) -> float:
    """prefill_time(context) / transfer time of its KV (> 1: transfer is faster)."""
    transfer_s = link.transfer_time(context_tokens * model.kv_bytes_per_token)
    if transfer_s <= 0:
        return float("inf")
    return compute.prefill_time(context_tokens) / transfer_s
