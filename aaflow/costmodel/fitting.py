"""Fitting a hardware profile's coefficients to measured samples (the measuring runs elsewhere).

Every fit is a non-negative least squares on relative errors (each sample weighted by 1 / its time),
so short and long calls count alike. Three unknowns at most: the exact NNLS is the best of the
least-squares fits on every subset of the unknowns whose coefficients come out non-negative.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace

import numpy as np

from aaflow.common.errors import CostModelError
from aaflow.costmodel.hardware import ComputeProfile, LinkProfile


def nnls(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||features @ x - y|| over x >= 0 (exact, by trying every support; for a few columns)."""
    # features: [samples, k], y: [samples]
    k = features.shape[1]
    scale = np.linalg.norm(features, axis=0)
    scale[scale == 0] = 1.0
    scaled = features / scale
    best, best_residual = np.zeros(k), float(np.sum(y**2))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            x_sub, *_ = np.linalg.lstsq(scaled[:, cols], y, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(k)
            x[cols] = x_sub
            residual = float(np.sum((scaled @ x - y) ** 2))
            if residual < best_residual:
                best, best_residual = x, residual
    return best / scale


def _fit(rows: list[list[float]], seconds: list[float], what: str, unknowns: int) -> tuple[float, ...]:
    if len(rows) < unknowns:
        raise CostModelError(f"{what}: need at least {unknowns} samples, got {len(rows)}")
    y = np.asarray(seconds, dtype=float)
    if np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise CostModelError(f"{what}: sample times must be positive and finite")
    weights = 1.0 / y
    x = nnls(np.asarray(rows, dtype=float) * weights[:, None], y * weights)
    return tuple(float(v) for v in x)


def _prefill_row(new_tokens: int, context_tokens: int) -> list[float]:
    return [1.0, float(new_tokens), new_tokens * (context_tokens + (new_tokens - 1) / 2)]


def _decode_row(batch: int, context_tokens: int) -> list[float]:
    return [1.0, float(batch), float(batch * context_tokens)]


def fit_prefill(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(new_tokens, context_tokens, seconds) -> (prefill_fixed_s, prefill_s_per_token, prefill_s_per_token_ctx)."""
    return _fit([_prefill_row(n, c) for n, c, _ in samples], [s for *_, s in samples], "fit_prefill", 3)


def fit_decode(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(batch, context_tokens, seconds per step) -> (decode_fixed_s, decode_s_per_seq, decode_s_per_seq_ctx)."""
    return _fit([_decode_row(b, c) for b, c, _ in samples], [s for *_, s in samples], "fit_decode", 3)


def fit_link(samples: list[tuple[int, float]]) -> LinkProfile:
    """(nbytes, seconds) -> a LinkProfile (latency_s >= 0, bandwidth from the slope)."""
    latency_s, s_per_byte = _fit([[1.0, float(n)] for n, _ in samples], [s for _, s in samples], "fit_link", 2)
    if s_per_byte <= 0:
        raise CostModelError("fit_link: time does not grow with size; measure a wider range of sizes")
    return LinkProfile(bandwidth_bytes_per_s=1.0 / s_per_byte, latency_s=latency_s)


def compute_profile_from_samples(prefill_samples: list[tuple[int, int, float]],
                                 decode_samples: list[tuple[int, int, float]]) -> ComputeProfile:
    """A ComputeProfile fitted to prefill samples (new, context, s) and decode samples (batch, context, s)."""
    return ComputeProfile(*fit_prefill(prefill_samples), *fit_decode(decode_samples))


def with_member_cost(profile: ComputeProfile, pack_samples: list[tuple[int, int, int, float]]) -> ComputeProfile:
    """`profile` with `prefill_s_per_member` fitted to packed prefills (members, tokens, context, s):
    what a pack of n members measured beyond n prefills of their tokens that share one fixed term."""
    measured_alone = {(t, c) for n, t, c, _ in pack_samples if n == 1}  # a pack is fitted only beside its single
    costs = []
    for n, tokens, context, seconds in pack_samples:
        if n > 1 and (tokens, context) in measured_alone:
            predicted = n * profile.prefill_time(tokens, context) - (n - 1) * profile.prefill_fixed_s
            costs.append((seconds - predicted) / (n - 1))
    if not costs:
        return profile
    return replace(profile, prefill_s_per_member=max(0.0, statistics.median(costs)))


def fit_quality(profile: ComputeProfile, prefill_samples: list[tuple[int, int, float]] = (),
                decode_samples: list[tuple[int, int, float]] = ()) -> float:
    """Median relative error |predicted - measured| / measured of `profile` over the given samples."""
    errors = [abs(profile.prefill_time(n, c) - s) / s for n, c, s in prefill_samples]
    errors += [abs(profile.decode_step_time(b, c) - s) / s for b, c, s in decode_samples]
    if not errors:
        raise CostModelError("fit_quality: no samples given")
    return statistics.median(errors)
