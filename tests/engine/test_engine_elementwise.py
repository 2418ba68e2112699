"""The fused bf16 elementwise kernels against the torch ops they replace (csrc/fused_elementwise.cpp)."""

import pytest
import torch

from aaflow.engine.elementwise import FUSED, Elementwise

pytestmark = pytest.mark.skipif(FUSED.load() is None, reason="the fused elementwise kernels did not build here")


def torch_ops() -> Elementwise:
    reference = Elementwise(torch.bfloat16, 1e-5)
    reference.kernels = None
    return reference


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many bf16 steps apart (same-sign values)."""
    assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_rounds_as_torch(ours: torch.Tensor, ref: torch.Tensor, sums_reordered: bool) -> None:
    apart = ulps_apart(ours, ref)
    if not sums_reordered:
        assert int(apart.max()) == 0, "elementwise products must round exactly as torch's ops"
        return
    assert int(apart.max()) <= 2 and float((apart > 0).float().mean()) < 1e-3


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_kernels_round_as_torch_ops(rows):
    g = torch.Generator().manual_seed(rows)
    fused, ref = Elementwise(torch.bfloat16, 1e-5), torch_ops()
    assert fused.kernels is not None
    x = (torch.randn(rows, 576, generator=g) * 3).bfloat16()
    delta = torch.randn(rows, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    assert_rounds_as_torch(fused.norm(x, w), ref.norm(x, w), sums_reordered=True)
    for ours, theirs in zip(fused.add_norm(x, delta, w), ref.add_norm(x, delta, w)):
        assert_rounds_as_torch(ours, theirs, sums_reordered=True)
    assert torch.equal(fused.add_norm(x, delta, w)[0], x + delta)  # the stream itself: exact

    qkv = torch.randn(rows, 960, generator=g).bfloat16()
    qk = qkv[:, :768].view(rows, 12, 64)  # strided rows, as the model slices q and k out of qkv
    cos, sin = (torch.randn(rows, 1, 64, generator=g).bfloat16() for _ in range(2))
    assert torch.equal(fused.rotate(qk, cos, sin), ref.rotate(qk, cos, sin))

    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails of exp and zeros
    assert_rounds_as_torch(fused.silu_mul(gate_up), ref.silu_mul(gate_up), sums_reordered=True)


def correctly_rounded_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's RMSNorm steps (fp32, cast to bf16 before the scale) from the correctly rounded fp32
    sum of each row's squares (a bf16's square is exact in fp32, their float64 sum exact to far below
    an fp32 ulp)."""
    squares = (x.double() ** 2).sum(-1, keepdim=True).float()
    return w * (x.float() * torch.rsqrt(squares / x.shape[-1] + eps)).bfloat16()


@pytest.mark.parametrize("scale", [1.0, 3.0, 30.0])
def test_rms_norm_takes_the_correctly_rounded_sum_of_squares(scale):
    """Bit for bit, on any vector width. The kernel's former fp32 sum in `omp simd` lanes rounded
    otherwise on some of these rows (on AVX2, each of the three cases); on one row of a SmolLM2
    prefill that flipped a near tie of the greedy first token (see `norm_row` in
    csrc/fused_elementwise.cpp)."""
    g = torch.Generator().manual_seed(int(scale))
    fused = Elementwise(torch.bfloat16, 1e-5)
    x = torch.randn(4096, 576, generator=g) * scale
    x[:, :3] *= 40  # a few outlier channels, as LLM hidden states have
    x = x.bfloat16()
    delta = torch.randn(4096, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    assert torch.equal(fused.norm(x, w), correctly_rounded_norm(x, w, 1e-5))
    _, normed = fused.add_norm(x, delta, w)
    assert torch.equal(normed, correctly_rounded_norm(x + delta, w, 1e-5))


def test_a_row_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(1)
    fused = Elementwise(torch.bfloat16, 1e-5)
    x = torch.randn(64, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    gate_up = torch.randn(64, 3072, generator=g).bfloat16()
    assert torch.equal(fused.norm(x, w)[5:6], fused.norm(x[5:6], w))
    assert torch.equal(fused.silu_mul(gate_up)[9:10], fused.silu_mul(gate_up[9:10]))


def test_bad_input_is_refused_with_a_message():
    fused = Elementwise(torch.bfloat16, 1e-5)
    with pytest.raises(RuntimeError, match="bf16"):
        fused.kernels.rms_norm(torch.randn(2, 8), torch.randn(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        fused.kernels.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(9).bfloat16(), 1e-5)


def test_other_dtypes_and_the_switch_keep_torch_ops(monkeypatch):
    assert Elementwise(torch.float32, 1e-5).kernels is None
    from aaflow.engine.native_build import NativeModule

    monkeypatch.setenv("AAFLOW_FUSED_ELEMENTWISE", "0")
    assert NativeModule("fused_elementwise.cpp", "test", "AAFLOW_FUSED_ELEMENTWISE").load() is None
