"""Weight and KV dtypes by name, and `"auto"`: bf16 where the CPU computes in bf16 natively, else fp32."""

from __future__ import annotations

import torch

from aaflow.common.machine import matrix_isa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (AVX512-BF16 or AMX). Without it oneDNN converts bf16 to
    fp32 around every op, so bf16 prefill and decode run slower than fp32 there
    (docs/RESULTS-history.md, "A CPU without native bf16")."""
    return matrix_isa() in ("amx", "avx512bf16")


def resolve_dtype(name: str) -> str:
    """A concrete dtype name: `name` itself, or for `"auto"` "bfloat16" with native bf16 and
    "float32" without. Raises ValueError naming the choices for anything else."""
    if name == "auto":
        return "bfloat16" if native_bf16() else "float32"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return name
