"""The AMX prefill attention kernel (csrc/amx_attention.cpp) against an fp32 reference, torch's flash
kernel, and itself split into parts. Runs only on a CPU with AMX (elsewhere the engine keeps flash)."""

import pytest
import torch
import torch.nn.functional as F

from aaflow.engine.amx_attention import AMX, amx_attention, amx_kernel, merge_parts
from aaflow.common.machine import matrix_isa

pytestmark = pytest.mark.skipif(matrix_isa() != "amx" or AMX.load() is None,
                                reason="needs a CPU with AMX and the kernel built (the engine uses torch's flash elsewhere)")


def kernel():
    return amx_kernel(torch.empty(1, 1, 64, dtype=torch.bfloat16))


def qkv(T: int, S: int, seed: int, heads: int = 9, kv_heads: int = 3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, heads, 64, generator=g).bfloat16(), torch.randn(S, kv_heads, 64, generator=g).bfloat16(),
            torch.randn(S, kv_heads, 64, generator=g).bfloat16())


def reference(q, k, v, offset):  # fp32: ([T, H, D], [T, H])
    T, H, D = q.shape
    S, group = k.shape[0], H // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->ths", q.float(), kf) * D ** -0.5
    visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + offset  # [T, S]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("ths,shd->thd", scores.softmax(-1), vf), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("T,S,offset", [(1, 1, 0), (5, 5, 0), (16, 16, 0), (17, 40, 23), (130, 257, 127),
                                        (300, 2300, 2000), (70, 2570, 2500), (37, 500, 10**6), (64, 2048, 2048)])
def test_matches_fp32_attention_within_bf16_rounding(T, S, offset):
    q, k, v = qkv(T, S, T + S)
    out, lse = amx_attention(kernel(), q, k, v, offset)
    ref_out, ref_lse = reference(q, k, v, offset)
    assert out.shape == (T, 9, 64) and out.dtype == torch.bfloat16 and lse.shape == (T, 9)
    assert float((out.float() - ref_out).abs().max()) < 2e-2  # probabilities and output rounded to bf16
    assert float((lse - ref_lse).abs().max()) < 1e-4


@pytest.mark.parametrize("T,start", [(600, 0), (200, 1500)])
def test_agrees_with_torch_flash_as_closely_as_flash_agrees_with_fp32(T, start):
    q, k, v = qkv(T, start + T, 7)
    out, _ = amx_attention(kernel(), q, k, v, start)
    visible = torch.arange(start + T)[None, :] <= start + torch.arange(T)[:, None]
    flash = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=visible[None, None], enable_gqa=True)[0].transpose(0, 1)
    ref, _ = reference(q, k, v, start)
    ours, theirs = float((out.float() - ref).abs().max()), float((flash.float() - ref).abs().max())
    assert ours <= 2 * theirs + 1e-3


def test_a_row_gets_the_same_bits_in_any_chunking():
    """Rows are independent: a prompt attended in one call or in chunks over the same keys (as
    incremental prefill does) gives identical bits."""
    q, k, v = qkv(300, 1300, 3)
    whole, whole_lse = amx_attention(kernel(), q, k, v, 1000)
    for a, b in [(0, 1), (1, 17), (17, 160), (160, 300)]:
        part, part_lse = amx_attention(kernel(), q[a:b], k, v, 1000 + a)
        assert torch.equal(part, whole[a:b]) and torch.equal(part_lse, whole_lse[a:b])


def test_parts_over_disjoint_keys_merge_to_the_whole():
    q, k, v = qkv(100, 900, 5)
    whole, _ = amx_attention(kernel(), q, k, v, 800)
    prefix = amx_attention(kernel(), q, k[:800], v[:800], 800)  # every row sees the whole prefix
    own = amx_attention(kernel(), q, k[800:], v[800:], 0)  # and its own keys causally
    merged = merge_parts(*prefix, *own)
    assert float((merged.float() - whole.float()).abs().max()) < 1e-2


def test_strided_rows_read_in_place():
    """K and V as views of a pool (rows of [slots, Hkv, D] with a wider row stride) and q as a view
    of a fused projection give what contiguous copies give."""
    q, k, v = qkv(40, 200, 9)
    fused = torch.cat([q.reshape(40, -1), torch.zeros(40, 64, dtype=q.dtype)], 1)[:, :9 * 64].view(40, 9, 64)
    wide_k = torch.zeros(200, 4, 64, dtype=k.dtype)
    wide_k[:, :3] = k
    out, _ = amx_attention(kernel(), fused, wide_k[:, :3], v, 160)
    assert torch.equal(out, amx_attention(kernel(), q, k.contiguous(), v, 160)[0])


def test_bad_input_is_refused_naming_the_tensor():
    q, k, v = qkv(4, 8, 1)
    with pytest.raises(RuntimeError, match="q must be bfloat16"):
        kernel().attention(q.float(), k, v, 0, 0.125)
    with pytest.raises(RuntimeError, match="k must be"):
        kernel().attention(q, torch.zeros(8, 3, 32, dtype=torch.bfloat16), v, 0, 0.125)
    with pytest.raises(RuntimeError, match="offset"):
        kernel().attention(q, k, v, -1, 0.125)
    assert amx_kernel(q.float()) is None  # the engine keeps torch's paths for fp32
