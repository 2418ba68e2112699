"""Linear layers, with oneDNN-prepacked weights where the CPU has native bf16 (AVX512-BF16 / AMX),
and a compiled one-row kernel (`csrc/one_row_linear.cpp`) for a decode step of one sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aaflow.engine.native_build import NativeModule

ONE_ROW = NativeModule("one_row_linear.cpp", "the bf16 one-row linear kernel", "AAFLOW_ONE_ROW_LINEAR")
_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)


def can_prepack(dtype: torch.dtype) -> bool:
    """oneDNN prepacking pays off for bf16 on CPUs with native bf16; fp32 keeps the plain path."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def one_row_kernel():
    """The one-row kernel where it builds with AVX512-BF16 (its plain C++ loop would lose to
    oneDNN); else None. `AAFLOW_ONE_ROW_LINEAR=0` switches it off."""
    module = ONE_ROW.load()
    return module if module is not None and module.vectorized else None


class Linear:
    """y = x @ W.T + b. With `prepack`, W is reordered once into oneDNN's blocked layout
    (measured here: ~1.3x faster at decode sizes, ~1.2x at prefill sizes). Where the one-row
    kernel builds, the plain W stays too (one more copy of the weights in memory) and a single row
    goes through the kernel (SmolLM2 bf16, Xeon with AMX, 2 threads: its 121 products 12.6
    against 14.8 ms; a whole decode step of one sequence 19.3 against 22.6 ms, and 24.1 against
    24.8 ms half an hour later, the machine slower: 3-15%)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool) -> None:
        self.out_features, self.in_features = weight.shape  # weight: [out, in]
        self.nbytes = weight.numel() * weight.element_size()  # what one product reads
        self.bias = bias
        self.prepacked = prepack
        self.one_row = None  # (kernel, plain W [out, in], bias [out] or empty) for single rows
        if prepack and self.in_features % 32 == 0 and (kernel := one_row_kernel()) is not None:
            plain_bias = _NO_BIAS if bias is None else bias.to(torch.bfloat16).contiguous()
            self.one_row = (kernel, weight.contiguous(), plain_bias)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if prepack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.one_row is not None and x.shape[0] == 1:
            kernel, weight, bias = self.one_row
            return kernel.one_row_linear(x.contiguous(), weight, bias)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
