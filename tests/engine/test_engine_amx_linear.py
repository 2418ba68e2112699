"""The AMX few-rows linear kernel (csrc/amx_linear.cpp, aaflow/engine/linear.py): the product of up
to AMX_MAX_ROWS rows rounded once from fp32 sums, with or without bias; a row's result does not
depend on the other rows of the call; more rows and odd widths keep oneDNN; long reductions stay on
the kernel longer (always in deterministic mode)."""

from __future__ import annotations

import pytest
import torch

from aaflow.engine import linear
from aaflow.engine.linear import AMX_MAX_ROWS, Linear, amx_linear_kernel, can_prepack, pack_for_amx

pytestmark = pytest.mark.skipif(not can_prepack(torch.bfloat16) or amx_linear_kernel() is None,
                                reason="needs a C++ compiler and a CPU with AMX")


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 sums of the bf16 inputs, plus the bias, rounded once to bf16."""
    y = x.float() @ w.float().T
    return (y if bias is None else y + bias.float()).bfloat16()


def within_one_ulp(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """fp32 sums in another order than the reference's: at most one bf16 ulp apart."""
    ulp = ref.float().abs().clamp_min(1e-3) * 2 ** -7
    return bool(((ours.float() - ref.float()).abs() <= ulp).all())


@pytest.mark.parametrize("out_features,in_features,rows,with_bias", [
    (576, 576, 1, False), (960, 576, 5, True), (576, 1536, 16, False), (3072, 576, 17, True),
    (64, 64, 33, False), (96, 128, 64, True), (32, 32, AMX_MAX_ROWS, False)])
def test_the_product_rounded_once(out_features, in_features, rows, with_bias):
    torch.manual_seed(rows)
    w = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    layer = Linear(w, bias, prepack=True)
    assert layer.amx is not None and layer.one_row is None  # the AMX copy replaces the plain one
    x = torch.randn(rows, in_features).bfloat16()
    ours = layer(x)
    assert ours.shape == (rows, out_features) and ours.dtype == torch.bfloat16
    assert within_one_ulp(ours, reference(x, w, bias))


def test_a_row_gets_the_same_bits_alone_and_among_others():
    torch.manual_seed(1)
    w = torch.randn(96, 192).bfloat16()
    layer = Linear(w, None, prepack=True)
    x = torch.randn(37, 192).bfloat16()  # three 16-row tiles, the last one partial
    together = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(37)])
    assert torch.equal(together, alone)


def test_the_weight_packing_is_the_tile_order():
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).bfloat16()
    packed = pack_for_amx(w)  # [2, 2, 16, 16, 2]
    assert packed.shape == (2, 2, 16, 16, 2)
    n, k = 21, 45  # output 21 = tile 1, column 5; input 45 = tile 1, pair row 6, element 1
    assert packed[1, 1, 6, 5, 1] == w[n, k]


def test_more_rows_deterministic_mode_and_odd_widths_keep_onednn(monkeypatch):
    torch.manual_seed(2)
    w = torch.randn(64, 96).bfloat16()
    layer = Linear(w, None, prepack=True)
    calls = []
    kernel, packed, bias = layer.amx
    spy = type("Spy", (), {"amx_linear": lambda self, *a: calls.append(a) or kernel.amx_linear(*a)})()
    layer.amx = (spy, packed, bias)
    many = torch.randn(AMX_MAX_ROWS + 1, 96).bfloat16()
    assert torch.allclose(layer(many).float(), reference(many, w, None).float(), rtol=2e-2, atol=2e-2)
    layer(many[:3], batch_invariant=True)
    assert calls == []  # both went to oneDNN
    layer(many[:3])
    assert len(calls) == 1
    one = layer(many[:1], batch_invariant=True)  # deterministic: oneDNN's many-row rounding for one row too
    assert torch.equal(one, layer(many[:2], batch_invariant=True)[:1])
    assert layer(many[:0]).shape == (0, 64) and len(calls) == 1  # no rows: oneDNN's empty product, no refusal
    odd = Linear(torch.randn(40, 64).bfloat16(), None, prepack=True)  # 40 outputs: no multiple of 32
    assert odd.amx is None and odd(torch.randn(2, 64).bfloat16()).shape == (2, 40)


def test_long_reductions_stay_on_the_kernel_longer_and_always_in_deterministic_mode():
    """oneDNN reduces K >= LONG_K in an order that depends on the row count (SmolLM2's down
    projection: 182 and 193-256 rows on 2 threads); the AMX kernel takes those products up to
    AMX_MAX_ROWS_LONG_K rows, and at any row count with batch_invariant."""
    torch.manual_seed(3)
    w = torch.randn(64, linear.LONG_K).bfloat16()
    layer = Linear(w, None, prepack=True)
    assert layer.amx_max_rows == linear.AMX_MAX_ROWS_LONG_K > AMX_MAX_ROWS
    calls = []
    kernel, packed, bias = layer.amx
    spy = type("Spy", (), {"amx_linear": lambda self, *a: calls.append(a[0].shape[0]) or kernel.amx_linear(*a)})()
    layer.amx = (spy, packed, bias)
    x = torch.randn(linear.AMX_MAX_ROWS_LONG_K + 1, linear.LONG_K).bfloat16()
    layer(x[:200])
    layer(x)  # one row too many: oneDNN
    layer(x, batch_invariant=True)
    assert calls == [200, linear.AMX_MAX_ROWS_LONG_K + 1]


@pytest.mark.parametrize("amx", [True, False])
def test_deterministic_rows_do_not_depend_on_the_call_with_a_long_reduction(amx, monkeypatch):
    """SmolLM2's down projection shape: a row's bits are the same in calls of any size, through the
    AMX kernel or, without it, through oneDNN in fixed blocks of rows."""
    if not amx:
        monkeypatch.setenv(linear.AMX_LINEAR.env_switch, "0")
    torch.manual_seed(4)
    w = (torch.randn(576, 1536) * 0.05).bfloat16()
    layer = Linear(w, None, prepack=True)
    assert (layer.amx is not None) == amx
    x = (torch.randn(700, 1536) * 2).bfloat16()
    whole = layer(x, batch_invariant=True)
    for rows in (1, 150, 182, 200, 256, 300):
        assert torch.equal(layer(x[:rows], batch_invariant=True), whole[:rows]), f"{rows} rows"
    assert torch.equal(layer(x[390:700], batch_invariant=True), whole[390:])


def test_bad_inputs_are_refused_by_name():
    kernel = amx_linear_kernel()
    packed = pack_for_amx(torch.randn(32, 64).bfloat16())
    none = torch.empty(0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="K"):
        kernel.amx_linear(torch.randn(2, 96).bfloat16(), packed, none)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.amx_linear(torch.randn(2, 64), packed, none)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.amx_linear(torch.randn(2, 64).bfloat16(), packed, torch.zeros(5).bfloat16())


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(linear.AMX_LINEAR.env_switch, "0")
    assert amx_linear_kernel() is None
    assert Linear(torch.randn(32, 64).bfloat16(), None, prepack=True).amx is None
