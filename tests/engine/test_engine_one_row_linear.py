"""The one-row linear kernel (csrc/one_row_linear.cpp, aaflow/engine/linear.py): a decode step of one
sequence gives the product rounded once from fp32 sums, with or without bias, and every other shape
keeps oneDNN's path. (On a CPU with AMX the AMX kernel takes single rows instead; it is switched
off here so that these tests reach the one-row kernel on every machine that builds it.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from aaflow.engine import linear
from aaflow.engine.linear import Linear, can_prepack, one_row_kernel

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None or not can_prepack(torch.bfloat16)
    or one_row_kernel() is None, reason="needs a C++ compiler and a CPU with AVX512-BF16")


@pytest.fixture(autouse=True)
def without_the_amx_kernel(monkeypatch):
    monkeypatch.setenv(linear.AMX_LINEAR.env_switch, "0")


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 sums of the bf16 inputs, plus the bias, rounded once to bf16."""
    y = x.float() @ w.float().T
    return (y if bias is None else y + bias.float()).bfloat16()


@pytest.mark.parametrize("out_features,in_features,with_bias", [(576, 576, False), (963, 1536, True), (5, 64, False)])
def test_one_row_gives_the_product_rounded_once(out_features, in_features, with_bias):
    torch.manual_seed(out_features)
    w = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    layer = Linear(w, bias, prepack=True)
    assert layer.one_row is not None
    x = torch.randn(1, in_features).bfloat16()
    ours, ref = layer(x), reference(x, w, bias)
    assert ours.shape == (1, out_features) and ours.dtype == torch.bfloat16
    # fp32 sums in another order than the reference's: at most one bf16 ulp apart
    ulp = ref.float().abs().clamp_min(1e-3) * 2 ** -7
    assert bool(((ours.float() - ref.float()).abs() <= ulp).all())


def test_rows_beyond_one_and_odd_widths_keep_onednn():
    torch.manual_seed(0)
    w = torch.randn(64, 96).bfloat16()
    layer = Linear(w, None, prepack=True)
    x = torch.randn(3, 96).bfloat16()
    assert torch.allclose(layer(x).float(), reference(x, w, None).float(), rtol=2e-2, atol=2e-2)
    odd = Linear(torch.randn(8, 40).bfloat16(), None, prepack=True)  # 40 is no multiple of 32
    assert odd.one_row is None and odd(torch.randn(1, 40).bfloat16()).shape == (1, 8)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(linear.ONE_ROW.env_switch, "0")
    assert one_row_kernel() is None
    assert Linear(torch.randn(8, 64).bfloat16(), None, prepack=True).one_row is None


def cancelling_row(width: int) -> torch.Tensor:
    """A row whose dot product with ones is 1 summed in one lane order and 0 in another: its
    AVX512 lanes hold 2^25 (lane 0), -2^25 (lane 2) and 1 (lane 8), and 2^25 + 1 rounds to 2^25."""
    row = torch.zeros(width)
    row[0], row[4], row[16] = 2.0 ** 25, -(2.0 ** 25), 1.0
    return row.bfloat16()


def test_a_row_gets_the_same_bits_alone_and_in_a_group_of_four():
    """A band's last rows are summed one at a time; they must give the bits a group of four gives,
    or a row's result depends on how the threads split the rows (once, the first decode step of a
    process changed a tiny model's logits by 5%)."""
    layer = Linear(cancelling_row(64).expand(5, -1).contiguous(), None, prepack=True)
    kernel, weight, bias = layer.one_row
    out = kernel.one_row_linear(torch.ones(1, 64).bfloat16(), weight, bias)  # rows 0-3 a group, row 4 alone
    assert out.float().tolist() == [[1.0] * 5]
