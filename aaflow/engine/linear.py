"""Linear layers, with oneDNN-prepacked weights where the CPU has native bf16 (AVX512-BF16 / AMX),
fp32 products on oneDNN where MKL's GEMM is not tuned for the CPU (AMD's),
a compiled AMX kernel for a few rows (`csrc/amx_linear.cpp`: decode steps, small prefill chunks)
where the CPU has AMX, and else a compiled one-row kernel (`csrc/one_row_linear.cpp`) for a decode
step of one sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aaflow.engine.native_build import NativeModule
from aaflow.common.machine import cpu_vendor, matrix_isa

ONE_ROW = NativeModule("one_row_linear.cpp", "the bf16 one-row linear kernel", "AAFLOW_ONE_ROW_LINEAR")
AMX_LINEAR = NativeModule("amx_linear.cpp", "the AMX few-rows linear kernel", "AAFLOW_AMX_LINEAR",
                          extra_cflags=("-mamx-tile", "-mamx-bf16"))
# Rows up to which the AMX kernel beats oneDNN (and, for one row, the one-row kernel): timed over
# SmolLM2's products by row count, its lead shrinks as rows grow and oneDNN wins from 224 rows
# (docs/RESULTS-history.md).
AMX_MAX_ROWS = 160
# oneDNN's bf16 GEMM splits a long reduction differently for some row counts, and those rows round
# unlike the same rows in any other call (SmolLM2's down projection, K = 1,536, on 2 threads: 182
# and 193-256 rows; on 1 thread: 130-160 and from 193 on; its K = 576 products never did): a
# prompt prefilled in chunks of 256 continued to other logits than one prefilled whole. Products
# over at least LONG_K inputs stay on the AMX kernel, whose sums run in one fixed order, up to
# AMX_MAX_ROWS_LONG_K rows; it is faster there too (the down projection alone up to 512 rows,
# slower at 1,024: docs/RESULTS-history.md).
LONG_K = 1024
AMX_MAX_ROWS_LONG_K = 512
# Deterministic mode without the AMX kernel runs those products on oneDNN in calls of this many rows.
INVARIANT_BLOCK_ROWS = 64
_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)
ONEDNN = torch.backends.mkldnn.is_available()


def can_prepack(dtype: torch.dtype) -> bool:
    """oneDNN prepacking pays off for bf16 on CPUs with native bf16; fp32 weights stay as they are."""
    return (
        dtype == torch.bfloat16
        and ONEDNN
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def fp32_on_onednn(dtype: torch.dtype) -> bool:
    """fp32 products go to oneDNN (the weights as they are) on AMD CPUs, where torch's MKL GEMM
    runs slower than oneDNN's at every row count of a decode step or a prefill; elsewhere to MKL."""
    return dtype == torch.float32 and ONEDNN and cpu_vendor() == "amd"


def one_row_kernel():
    """The one-row kernel where it builds with AVX512-BF16 (its plain C++ loop would lose to
    oneDNN); else None. `AAFLOW_ONE_ROW_LINEAR=0` switches it off."""
    module = ONE_ROW.load()
    return module if module is not None and module.vectorized else None


def amx_linear_kernel():
    """The AMX few-rows kernel where the CPU has AMX and Linux grants it; else None.
    `AAFLOW_AMX_LINEAR=0` switches it off."""
    if matrix_isa() != "amx":
        return None
    module = AMX_LINEAR.load()
    return module if module is not None and module.ready() else None


def pack_for_amx(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N / 16, K / 32, 16, 16, 2]
    """W as the AMX kernel's B tiles, in the order it reads them: per 16 outputs n, per 32 inputs,
    16 rows of input pairs (2r, 2r + 1) x 16 outputs: packed[n / 16, k / 32, r, n % 16, e] =
    W[n, 32 (k / 32) + 2r + e]."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


class Linear:
    """y = x @ W.T + b. With `onednn`, on oneDNN with W as it is. With `prepack`, W is reordered
    once into oneDNN's blocked layout (faster at decode and prefill sizes: docs/RESULTS-history.md),
    and one more copy of the weights is kept for a compiled kernel: on a CPU with AMX (and both
    sizes multiples of 32) W as AMX tiles, and up to AMX_MAX_ROWS rows
    (AMX_MAX_ROWS_LONG_K over LONG_K inputs or more) go through the AMX kernel; else, where the
    one-row kernel builds, the plain W, and a single row goes through it (faster than oneDNN for
    one row, and so a shorter decode step of one sequence).

    `batch_invariant=True` (the engine's deterministic mode) gives a row the same bits whatever
    the number of rows in the call: products over LONG_K inputs or more on the AMX kernel at any
    row count (without it: oneDNN in blocks of INVARIANT_BLOCK_ROWS), the others on oneDNN's
    many-row path (one row runs as two), in fp32 too (MKL's GEMM rounds a row by the row count)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool, onednn: bool = False) -> None:
        self.out_features, self.in_features = weight.shape  # weight: [out, in]
        self.nbytes = weight.numel() * weight.element_size()  # what one product reads
        self.bias = bias
        self.on_onednn = prepack or onednn  # else torch's default GEMM (MKL)
        # deterministic mode's products: on oneDNN in fp32 even where the others go to MKL
        self.invariant_on_onednn = self.on_onednn or (ONEDNN and weight.dtype == torch.float32)
        kernel_bias = _NO_BIAS if bias is None else bias.to(torch.bfloat16).contiguous()
        self.amx = None  # (kernel, W as AMX tiles, bias [out] or empty) for up to amx_max_rows rows
        self.amx_max_rows = AMX_MAX_ROWS_LONG_K if self.in_features >= LONG_K else AMX_MAX_ROWS
        self.one_row = None  # (kernel, plain W [out, in], bias [out] or empty) for single rows
        if prepack and self.in_features % 32 == 0:
            if self.out_features % 32 == 0 and (kernel := amx_linear_kernel()) is not None:
                self.amx = (kernel, pack_for_amx(weight.contiguous()), kernel_bias)
            elif (kernel := one_row_kernel()) is not None:
                self.one_row = (kernel, weight.contiguous(), kernel_bias)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if prepack else weight

    def __call__(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:  # x: [T, in] -> [T, out]
        rows = x.shape[0]
        if batch_invariant:
            if rows and self.in_features >= LONG_K:  # oneDNN's reduction order depends on the rows
                return self._amx(x) if self.amx is not None else self._onednn_in_blocks(x)
            if rows == 1:  # oneDNN's one-row kernel rounds unlike the many-row one
                return self._onednn(x.expand(2, -1).contiguous())[:1]
        elif self.amx is not None and 0 < rows <= self.amx_max_rows:
            return self._amx(x)
        elif self.one_row is not None and rows == 1:
            kernel, weight, bias = self.one_row
            return kernel.one_row_linear(x.contiguous(), weight, bias)
        if self.on_onednn or batch_invariant:
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)  # torch's default GEMM (MKL)

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        kernel, packed, bias = self.amx
        return kernel.amx_linear(x.contiguous(), packed, bias)

    def _onednn_in_blocks(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        """oneDNN on blocks of exactly INVARIANT_BLOCK_ROWS rows (the last zero-padded): every call
        has the same shape, so oneDNN reduces each row in the same order whatever T is."""
        rows = x.shape[0]
        padded = F.pad(x, (0, 0, 0, -rows % INVARIANT_BLOCK_ROWS))  # [T rounded up to a whole block, in]
        return torch.cat([self._onednn(block) for block in padded.split(INVARIANT_BLOCK_ROWS)])[:rows]

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        if not self.invariant_on_onednn:  # bf16 without native support: torch's default path
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
