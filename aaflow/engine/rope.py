"""Rotary position embeddings (RoPE) with the scaling types the engine supports."""

from __future__ import annotations

import math

import torch

from aaflow.engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The RoPE inverse frequencies, float32 [head_dim // 2], after the model's scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(config.rope_scaling)
    if config.rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif config.rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, s: dict[str, float]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """Precomputed cos/sin for every position, for q/k in the non-interleaved (HF) layout (applied by
    `Elementwise.rotate`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        self._inv_freq = inverse_frequencies(config)  # [D/2]
        freqs = positions[:, None] * self._inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin), each [T, 1, D], to pass to `Elementwise.rotate`."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys rotated for position p moved to p + delta (RoPE rotations compose): [..., D] -> same.

        Rotation happens in float32 and the result is cast back, so bf16 keys lose at most one rounding.
        """
        inv_freq = self._inv_freq
        angle = torch.tensor(float(delta)) * inv_freq  # [D/2]
        emb = torch.cat((angle, angle))  # [D]
        k32 = k.float()
        half = k.shape[-1] // 2
        rotated = torch.cat((-k32[..., half:], k32[..., :half]), dim=-1)
        return (k32 * emb.cos() + rotated * emb.sin()).to(k.dtype)

    def shift_kv(self, kv: torch.Tensor, delta: int) -> torch.Tensor:
        """kv [layers, 2, n, kv_heads, head_dim] with its keys moved by `delta` positions (values
        unchanged): a new tensor of the same shape."""
        shifted = kv.clone()
        shifted[:, 0] = self.shift_keys(kv[:, 0], delta)
        return shifted
