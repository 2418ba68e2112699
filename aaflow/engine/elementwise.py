"""The decoder's elementwise steps (RMSNorm, the residual add before it, RoPE, SiLU(gate) * up):
fused compiled kernels for bf16 (`csrc/fused_elementwise.cpp`), torch ops for other dtypes.

Why: in bf16 torch runs each step as several ops, each a pass over memory with dtype conversions;
over a long prefill those ops add up to a sizeable share of its time (docs/RESULTS-history.md).
The kernels round where torch rounds (see the C++ file); a value may differ from torch's by one
bf16 ulp where torch's fp32 sum of a row's squares is not the correctly rounded one (the kernel's
is, on any vector width) or exp is approximated.
`AAFLOW_FUSED_ELEMENTWISE=0` keeps the torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aaflow.engine.native_build import NativeModule

# 512-bit vectors where the CPU has them (GCC otherwise prefers 256 on Xeons): the loops are plain C++
FUSED = NativeModule("fused_elementwise.cpp", "the bf16 fused elementwise kernels", "AAFLOW_FUSED_ELEMENTWISE",
                     extra_cflags=("-mprefer-vector-width=512",))


class Elementwise:
    """The elementwise steps for one model dtype and RMSNorm epsilon."""

    def __init__(self, dtype: torch.dtype, eps: float) -> None:
        self.dtype = dtype
        self.eps = eps
        self.kernels = FUSED.load() if dtype == torch.bfloat16 else None

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # x: [T, H] -> [T, H]
        """`weight * rms_norm(x)`, normalized in float32 and cast back before the scale (HF's order)."""
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return weight * normed.to(self.dtype)

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # h, delta: [T, H] -> ([T, H], [T, H])
        """(h + delta, norm(h + delta)); delta None adds nothing."""
        if delta is None:
            return h, self.norm(h, weight)
        if self.kernels is not None:
            total, normed = self.kernels.add_rms_norm(h, delta, weight, self.eps)
            return total, normed
        total = h + delta
        return total, self.norm(total, weight)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE: x [T, R, D] (heads contiguous) by cos, sin [T, 1, D] -> [T, R, D], HF's half-split layout."""
        if self.kernels is not None and x.stride(1) == x.shape[2] and x.stride(2) == 1:
            return self.kernels.rotate(x, cos.squeeze(1), sin.squeeze(1))
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] (gate, then up) -> [T, I]
        """SiLU(gate) * up."""
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
