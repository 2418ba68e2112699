"""The compiled bf16 decode attention kernel (decode_kernel.py): the attention of the rounded math
over paged, scattered slots; a sequence's result independent of its batch; the engine's decode
through it against its torch product path. Needs a C++ compiler (the kernel is built on first use)."""

from __future__ import annotations

import shutil

import pytest
import torch

from aaflow.engine import decode_kernel
from aaflow.models.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler here: the decode kernel cannot be built")

KV_HEADS, GROUP, DIM = 3, 3, 64


@pytest.fixture(scope="module")
def kernel():
    module = decode_kernel.load()
    assert module is not None, "a compiler is present, so the decode kernel must build"
    return module


def _reference(q, k_cache, v_cache, slots):  # q: [H, D]; caches [slots, Hkv, D]; slots [n] -> [H, D]
    """The kernel's rounding in plain torch: fp32 products, scores and probabilities rounded to bf16."""
    keys = k_cache[slots].float().repeat_interleave(GROUP, dim=1)  # [n, H, D]
    values = v_cache[slots].float().repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.float(), keys).bfloat16()  # [H, n]
    probs = torch.softmax(scores.float(), dim=-1).bfloat16().float()
    return torch.einsum("hn,nhd->hd", probs, values)


def _paged_batch(lengths: list[int], seed: int = 0):
    """A pool of scattered slots: each context is a random permutation of free slots (not runs)."""
    gen = torch.Generator().manual_seed(seed)
    pool = sum(lengths) + 100
    k_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen).bfloat16()
    v_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen).bfloat16()
    order = torch.randperm(pool, generator=gen)
    contexts, start = [], 0
    for n in lengths:
        contexts.append(order[start:start + n])
        start += n
    q = (torch.randn(len(lengths), KV_HEADS * GROUP, DIM, generator=gen) * DIM ** -0.5).bfloat16()
    return q, k_cache, v_cache, contexts


def _run(kernel, q, k_cache, v_cache, contexts):
    reads = decode_kernel.KernelReads.of(contexts)
    scores = kernel.decode_scores(q.contiguous(), k_cache, reads.slots, reads.lengths)
    return kernel.decode_values(torch.softmax(scores, dim=-1), v_cache, reads.slots, reads.lengths)


def test_kernel_is_the_rounded_attention_over_scattered_slots(kernel):
    lengths = [1, 2, 7, 255, 256, 257, 1031]  # tails of the 4-key tiles, the key pairs and the 256-key chunks
    q, k_cache, v_cache, contexts = _paged_batch(lengths)
    out = _run(kernel, q, k_cache, v_cache, contexts).float()  # [B, H, D]
    for b, slots in enumerate(contexts):
        ref = _reference(q[b], k_cache, v_cache, slots)
        ulp = ref.abs().max() * 2 ** -7  # one bf16 rounding of the largest output, plus summation order
        assert float((out[b] - ref).abs().max()) <= ulp, f"sequence {b} of length {lengths[b]}"


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(kernel):
    q, k_cache, v_cache, contexts = _paged_batch([300, 1500, 9, 700], seed=1)
    together = _run(kernel, q, k_cache, v_cache, contexts)
    for b in range(len(contexts)):
        alone = _run(kernel, q[b:b + 1], k_cache, v_cache, [contexts[b]])
        assert torch.equal(alone[0], together[b])
    reversed_ = _run(kernel, q.flip(0), k_cache, v_cache, contexts[::-1])
    assert torch.equal(reversed_.flip(0), together)


def test_a_key_gets_the_same_score_whatever_the_context_length(kernel):
    """Keys past a context's last group of four are summed one at a time, in the group's lane order,
    so a key's score does not change as the context grows past it. Each key's head here dots with
    the ones query to 1 in that order and to 0 in another (2^25 + 1 rounds to 2^25)."""
    key = torch.zeros(DIM)
    key[0], key[4], key[16] = 2.0 ** 25, -(2.0 ** 25), 1.0
    k_cache = key.expand(8, KV_HEADS, DIM).contiguous().bfloat16()
    q = torch.ones(1, KV_HEADS * GROUP, DIM).bfloat16()
    reads = decode_kernel.KernelReads.of([torch.arange(5)])  # keys 0-3 a group, key 4 alone
    scores = kernel.decode_scores(q, k_cache, reads.slots, reads.lengths)
    assert scores.float().unique().tolist() == [1.0]


def test_kernel_refuses_what_it_was_not_built_for(kernel):
    q, k_cache, v_cache, contexts = _paged_batch([10])
    reads = decode_kernel.KernelReads.of(contexts)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.decode_scores(q.float(), k_cache, reads.slots, reads.lengths)
    with pytest.raises(RuntimeError, match="head dim"):
        kernel.decode_scores(q[..., :32].contiguous(), k_cache[..., :32].contiguous(), reads.slots, reads.lengths)
    assert decode_kernel.supports(torch.bfloat16, 64) and not decode_kernel.supports(torch.float32, 64)
    assert not decode_kernel.supports(torch.bfloat16, 16)


def test_engine_decode_through_the_kernel_matches_its_product_path(make_engine, tmp_path):
    """A bf16 model with 64-dim heads: two sequences whose blocks interleave, decoded together and
    alone, through the kernel and through the torch products; logits agree to bf16 rounding and the
    greedy tokens are the same."""
    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engines = [make_engine(folder, num_blocks=64, dtype="bfloat16") for _ in range(2)]
    assert engines[0].runner.kernel_decode
    engines[1].runner.kernel_decode = False
    logits = []
    for engine in engines:
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.prefill(a, [3 + (i * 7) % 250 for i in range(150)])
        engine.prefill(b, [5 + (i * 11) % 250 for i in range(90)])
        steps = [engine.decode([a, b], [10 + i, 20 + i]) for i in range(20)]
        steps += [engine.decode([a], [40 + i]) for i in range(5)]
        logits.append(torch.cat(steps).float())
        engine.free(a)
        engine.free(b)
    ours, ref = logits
    assert float((ours - ref).abs().max() / ref.abs().max()) <= 2e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(decode_kernel.ENV_SWITCH, "0")
    assert decode_kernel.load() is None and not decode_kernel.supports(torch.bfloat16, 64)


def test_short_prefill_chunks_through_the_kernel_match_their_tiles(make_engine, tmp_path):
    """Packed prefill where some chunks are short enough for the kernel (a row per token, causal
    among the chunk's own tokens) and one is tiled, against every chunk tiled."""
    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engines = [make_engine(folder, num_blocks=64, dtype="bfloat16") for _ in range(2)]
    engines[1].runner.kernel_decode = False
    for engine in engines:  # tiles, not the flash kernel, on every CPU
        engine.runner.flash_prefill = False
    chunks = [[7, 8, 9], [11], [20 + i for i in range(40)], [30 + i for i in range(8)]]
    results, routed = [], []
    for engine in engines:
        ids = [engine.new_sequence() for _ in chunks]
        for n, seq in enumerate(ids):
            engine.prefill(seq, [3 + (i * (5 + n)) % 250 for i in range(60 + 30 * n)])
        logits, _ = engine.prefill_packed(ids, chunks)
        results.append(logits.float())
        for seq in ids:
            engine.free(seq)
    ours, ref = results
    assert float((ours - ref).abs().max() / ref.abs().max()) <= 2e-2
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_short_chunks_are_routed_to_the_kernel_and_long_ones_to_tiles():
    from aaflow.engine.tiled_attention import KERNEL_ROW_TOKENS, TiledPrefillBatch

    contexts = [torch.arange(10, 23), torch.arange(100, 100 + 50 + KERNEL_ROW_TOKENS + 1), torch.arange(300, 305)]
    starts = [10, 50, 0]  # 3 new tokens; KERNEL_ROW_TOKENS + 1 new tokens; a fresh 5-token prompt
    batch = TiledPrefillBatch.build(contexts, starts, kernel_rows=True)
    assert batch.tiled == [1]
    short = 3 + 5
    assert batch.row_tokens.tolist() == [0, 1, 2] + list(range(3 + KERNEL_ROW_TOKENS + 1, 3 + KERNEL_ROW_TOKENS + 1 + 5))
    assert batch.rows.lengths.tolist() == [11, 12, 13, 1, 2, 3, 4, 5] and len(batch.rows.lengths) == short
    assert TiledPrefillBatch.build(contexts, starts).rows is None


def test_a_large_batch_sharing_a_prefix_decodes_in_cascade_as_close_to_fp32_as_the_kernel(make_engine, tmp_path,
                                                                                          monkeypatch):
    """Where cascade is chosen for a large batch sharing a prefix (AMX; forced here on every CPU), a
    step of 12 sequences takes it instead of the kernel, and its logits are as close to fp32's as
    the kernel's (both round differently: the kernel's scores go to bf16, cascade's stay fp32 in the
    flash kernel); a batch without a shared prefix stays on the kernel."""
    from aaflow.engine.cascade import CascadeBatch

    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engines = [make_engine(folder, num_blocks=128, dtype=dtype) for dtype in ("bfloat16", "bfloat16", "float32")]
    engines[0].runner.cascade_decode_batch, engines[1].runner.cascade_decode_batch = 3, None
    engines[0].runner.cascade_decode_min_reads = 1024  # 12 x 160 shared tokens: cascade here
    kinds = []
    forward = engines[0].runner.model.forward
    monkeypatch.setattr(engines[0].runner.model, "forward",
                        lambda *a, **k: kinds.append(type(a[3]).__name__) or forward(*a, **k))
    shared = [3 + (i * 7) % 250 for i in range(160)]  # 11 x 160 reads saved: over CASCADE_MIN_SAVED_TOKENS
    logits = []
    for engine in engines:
        seqs = [engine.new_sequence() for _ in range(12)]
        for n, seq in enumerate(seqs):
            engine.prefill(seq, shared + [9 + n] * (5 + n))
        logits.append(torch.cat([engine.decode(seqs, [30 + i + n for n in range(12)]) for i in range(6)]).float())
        for seq in seqs:
            engine.free(seq)
    assert kinds[-6:] == [CascadeBatch.__name__] * 6
    cascade, kernel, fp32 = logits
    err = {name: float((x - fp32).abs().max() / fp32.abs().max()) for name, x in (("cascade", cascade), ("kernel", kernel))}
    assert err["cascade"] <= 1.5 * err["kernel"] + 1e-2, err
    alone = engines[0]
    seqs = [alone.new_sequence() for _ in range(3)]
    for n, seq in enumerate(seqs):
        alone.prefill(seq, [5 + n + (i * 11) % 250 for i in range(40)])
    alone.decode(seqs, [1, 2, 3])
    assert kinds[-1] == "KernelDecodeBatch"
    for seq in seqs:
        alone.free(seq)
