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
    from aaflow.common.machine import matrix_isa

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
    engines[0].runner.paths.tiled_prefill, engines[1].runner.paths.tiled_prefill = True, False
    engines[0].runner.paths.flash_prefill = flash
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


def test_shared_prefix_is_the_common_leading_slots_up_to_the_first_new_token(monkeypatch):
    from aaflow.engine import shared_prefix_prefill as spp

    monkeypatch.setattr(spp, "SHARED_PREFIX_MIN_TOKENS", 8)
    prefix = torch.arange(100, 120)
    contexts = [torch.cat([prefix, torch.arange(500, 505)]), torch.cat([prefix[:17], torch.arange(600, 610)]),
                torch.cat([prefix, torch.arange(700, 703)])]
    assert spp.shared_prefix_tokens(contexts, [20, 20, 20]) == 17  # the second leaves the prefix at 17
    assert spp.shared_prefix_tokens([contexts[0], contexts[2]], [20, 12]) == 12  # never past a new token
    assert spp.shared_prefix_tokens([contexts[0], contexts[2]], [5, 20]) == 0  # under the minimum
    assert spp.shared_prefix_tokens(contexts[:1], [20]) == 0  # one sequence shares nothing


def test_shared_prefix_attention_gives_each_members_causal_attention():
    from aaflow.engine.shared_prefix_prefill import shared_prefix_attention

    torch.manual_seed(3)
    shared, pk, pv = 40, torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    members = [(5, 50), (12, 40), (1, 70)]  # (new tokens, start)
    qs, own_k, own_v, refs = [], [], [], []
    for T, start in members:
        k = torch.cat([pk, torch.randn(start + T - shared, 2, 16)])
        v = torch.cat([pv, torch.randn(start + T - shared, 2, 16)])
        q = torch.randn(T, 6, 16)
        qs.append(q), own_k.append(k[shared:]), own_v.append(v[shared:]), refs.append(reference(q, k, v, start))
    outs = shared_prefix_attention(qs, pk, pv, own_k, own_v, [s for _, s in members])
    for out, ref in zip(outs, refs):
        assert rel_err(out, ref) <= 1e-5
    bf16 = shared_prefix_attention([q.bfloat16() for q in qs], pk.bfloat16(), pv.bfloat16(),
                                   [k.bfloat16() for k in own_k], [v.bfloat16() for v in own_v], [s for _, s in members])
    for out, ref in zip(bf16, refs):
        assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref) <= 3e-2


def tiles_against_flash(make_engine, model_dir, monkeypatch, flash: bool, num_blocks: int = 96):
    """Two fp32 engines: the first with tiles forced on (through the flash route or not), the second
    on the flash kernel's paths; and the list every `TiledPrefillBatch` built from now on lands in."""
    from aaflow.engine import tiled_attention

    built = []
    build = tiled_attention.TiledPrefillBatch.build
    monkeypatch.setattr(tiled_attention.TiledPrefillBatch, "build",
                        classmethod(lambda cls, *a, **k: built.append(build(*a, **k)) or built[-1]))
    engines = [make_engine(model_dir, num_blocks=num_blocks, dtype="float32") for _ in range(2)]
    engines[0].runner.paths.tiled_prefill, engines[1].runner.paths.tiled_prefill = True, False
    engines[0].runner.paths.flash_prefill = flash
    return built, engines


def test_engine_pack_over_a_shared_prefix_in_cascade_gives_the_flash_path_logits(make_engine, tiny_llama_dir, monkeypatch):
    """fp32, tiles forced on with the flash route: a pack whose members continue one cached prefix
    attends it once (`TiledPrefillBatch.shared`), with the logits of the flash kernel's paths."""
    from aaflow.engine import shared_prefix_prefill as spp

    monkeypatch.setattr(spp, "SHARED_PREFIX_MIN_TOKENS", 64)
    built, engines = tiles_against_flash(make_engine, tiny_llama_dir, monkeypatch, flash=True)
    prefix = [3 + (i * 7) % 250 for i in range(160)]
    results = []
    for engine in engines:
        first = engine.new_sequence()
        engine.prefill(first, prefix)  # cached: the pack's members reuse its blocks
        members = [engine.new_sequence() for _ in range(3)]
        logits, reused = engine.prefill_packed(members, [prefix + [9 + n] * (4 + 7 * n) for n in range(3)])
        assert reused == [160, 160, 160]
        results.append(logits)
        for s in [first] + members:
            engine.free(s)
    assert built[-1].shared == 160
    assert rel_err(results[0], results[1]) <= 1e-5
