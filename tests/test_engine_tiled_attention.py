"""Prefill attention in tiles of plain products (tiled_attention.py): the results of causal attention
over the whole context, in fp32 to float rounding and in bf16 within its rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aaflow.engine.tiled_attention import TILE_TOKENS, flash_prefill_attention, prefill_kernel, tiled_prefill_attention


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """fp32 attention of q ([T, H, D], positions start..) over k, v ([start + T, Hkv, D]) -> [T, H * D]."""
    T, ctx = q.shape[0], k.shape[0]
    allowed = torch.arange(ctx)[None, :] <= (start + torch.arange(T))[:, None]  # [T, ctx]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                         v.float().transpose(0, 1), attn_mask=allowed, enable_gqa=True)
    return out.transpose(0, 1).reshape(T, -1)


@pytest.mark.parametrize("length,start", [(1, 0), (TILE_TOKENS, 0), (2 * TILE_TOKENS + 37, 0), (5, 300),
                                          (TILE_TOKENS + 1, 90)])
def test_tiles_give_causal_attention_over_the_context(length, start):
    torch.manual_seed(length + start)
    q = torch.randn(length, 6, 16)  # 6 query heads over 2 kv heads
    k, v = torch.randn(start + length, 2, 16), torch.randn(start + length, 2, 16)
    ref = reference(q, k, v, start)
    assert rel_err(tiled_prefill_attention(q, k, v, start), ref) <= 1e-5
    bf16 = tiled_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), start)
    assert bf16.dtype == torch.bfloat16 and rel_err(bf16.float(), ref) <= 3e-2


@pytest.mark.parametrize("length,start", [(1, 0), (300, 0), (5, 300), (120, 90), (300, 16), (64, 64)])
def test_flash_gives_causal_attention_over_the_context(length, start):
    """The flash route: a fresh prompt (causal), few new tokens over many (masked), and as many new
    tokens as earlier ones or more (two calls merged by their log-sum-exps)."""
    torch.manual_seed(length + start)
    q = torch.randn(length, 6, 16)
    pool = torch.randn(start + length + 50, 2, 16)
    k, v = pool[20:20 + start + length], torch.randn(start + length, 2, 16)  # k: strided rows of a pool
    ref = reference(q, k, v, start)
    assert rel_err(flash_prefill_attention(q, k, v, start), ref) <= 1e-5
    bf16 = flash_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), start)
    assert bf16.dtype == torch.bfloat16 and rel_err(bf16.float(), ref) <= 3e-2


def test_prefill_kernel_choice_follows_the_cpu_and_the_override(monkeypatch):
    from aaflow.machine import matrix_isa

    monkeypatch.delenv("AAFLOW_PREFILL_ATTENTION", raising=False)
    assert prefill_kernel() == ("flash" if matrix_isa() == "amx" else "tiles")
    monkeypatch.setenv("AAFLOW_PREFILL_ATTENTION", "Tiles")
    assert prefill_kernel() == "tiles"
    monkeypatch.setenv("AAFLOW_PREFILL_ATTENTION", "fast")
    with pytest.raises(ValueError, match="AAFLOW_PREFILL_ATTENTION='fast'"):
        prefill_kernel()


def test_keys_may_be_strided_views_of_the_pool():
    torch.manual_seed(1)
    pool = torch.randn(500, 2, 16)
    q, k, v = torch.randn(40, 4, 16), pool[100:260], pool[240:400]  # rows of the pool, any row stride
    assert rel_err(tiled_prefill_attention(q, k, v, 120), reference(q, k, v, 120)) <= 1e-5


@pytest.mark.parametrize("flash", [False, True])
def test_engine_prefill_in_tiles_gives_the_flash_path_logits(make_engine, tiny_llama_dir, flash):
    """In fp32 with tiles forced on (each sequence in tiles, or through `flash_prefill_attention`): a
    fresh prompt, chunks over a context in one run of slots and over scattered blocks, and several
    sequences packed in one pass, against the flash kernel's paths."""
    engines = [make_engine(tiny_llama_dir, num_blocks=96, dtype="float32") for _ in range(2)]
    engines[0].runner.tiled_prefill, engines[1].runner.tiled_prefill = True, False
    engines[0].runner.flash_prefill = flash
    results = []
    for engine in engines:
        a, b, c = engine.new_sequence(), engine.new_sequence(), engine.new_sequence()
        out = [engine.prefill(a, [3 + (i * 7) % 250 for i in range(300)], chunk_size=128, all_logits=True)]
        out.append(engine.prefill(b, [5 + (i * 11) % 250 for i in range(70)], all_logits=True))
        for step in range(3):  # a and b grow in turns: their later blocks interleave
            out.append(engine.prefill(a, [9 + step] * 20, all_logits=True))
            out.append(engine.prefill(b, [11 + step] * 20, all_logits=True))
        packed, _ = engine.prefill_packed([a, b, c], [[7] * 33, [8] * 50, [4 + i for i in range(140)]])
        out.append(packed)
        results.append(out)
        for s in (a, b, c):
            engine.free(s)
    for i, (ours, ref) in enumerate(zip(*results)):
        assert rel_err(ours, ref) <= 1e-5, f"pass {i}"
