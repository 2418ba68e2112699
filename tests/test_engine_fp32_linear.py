"""fp32 products on oneDNN where MKL's GEMM is not tuned for the CPU (AMD's): same values as torch's
default path to fp32 rounding, at every row count a decode step, a pack or a prefill uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aaflow.engine.linear import Linear, fp32_on_onednn
from aaflow.machine import cpu_vendor


def test_fp32_goes_to_onednn_on_amd_only_and_bf16_never():
    assert fp32_on_onednn(torch.float32) == (cpu_vendor() == "amd" and torch.backends.mkldnn.is_available())
    assert not fp32_on_onednn(torch.bfloat16)


@pytest.mark.parametrize("rows", [0, 1, 2, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_onednn_fp32_product_equals_torchs_to_rounding(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)  # [out, in]
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 128, generator=gen)[:, ::2]  # [rows, 64], not contiguous
    layer = Linear(weight, b, prepack=False, onednn=True)
    assert layer.on_onednn
    for invariant in (False, True):
        torch.testing.assert_close(layer(x, batch_invariant=invariant), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_the_loader_follows_the_rule(tiny_llama_dir):
    from aaflow.engine.config import ModelConfig
    from aaflow.engine.weights import load_weights

    weights = load_weights(tiny_llama_dir, ModelConfig.from_folder(tiny_llama_dir), torch.float32)
    layers = [weights.lm_head] + [getattr(w, name) for w in weights.layers for name in ("qkv", "o", "gate_up", "down")]
    assert {layer.on_onednn for layer in layers} == {fp32_on_onednn(torch.float32)}
