"""The compiled decode attention kernel (decode_kernel.py), bf16 and fp32: attention over paged,
scattered slots against fp32 math, alone and merged with a part over other keys; a sequence's result
independent of its batch; the engine's decode through it against its torch paths. Needs a C++
compiler (the kernel is built on first use)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from aaflow.engine import decode_kernel
from aaflow.models.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler here: the decode kernel cannot be built")

KV_HEADS, GROUP, DIM = 3, 3, 64
# The output's error against fp32 math, relative to its largest value: bf16 rounds the output and
# the probabilities; fp32 differs only in summation order and the softmax's exp polynomial.
TOLERANCE = {torch.bfloat16: 2 ** -6, torch.float32: 1e-5}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


@pytest.fixture(scope="module")
def kernel():
    module = decode_kernel.load()
    assert module is not None, "a compiler is present, so the decode kernel must build"
    return module


def _reference(q, k_cache, v_cache, slots):  # q: [H, D], scaled; caches [slots, Hkv, D]; slots [n]
    """fp32 attention: ([H, D], log-sum-exp of the scores [H])."""
    keys = k_cache[slots].float().repeat_interleave(GROUP, dim=1)  # [n, H, D]
    values = v_cache[slots].float().repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.float(), keys)  # [H, n]
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values), scores.logsumexp(-1)


def _paged_batch(lengths: list[int], seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A pool of scattered slots: each context is a random permutation of free slots (not runs)."""
    gen = torch.Generator().manual_seed(seed)
    pool = sum(lengths) + 100
    k_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen).to(dtype)
    order = torch.randperm(pool, generator=gen)
    contexts, start = [], 0
    for n in lengths:
        contexts.append(order[start:start + n])
        start += n
    q = (torch.randn(len(lengths), KV_HEADS * GROUP, DIM, generator=gen) * DIM ** -0.5).to(dtype)
    return q, k_cache, v_cache, contexts


def _run(kernel, q, k_cache, v_cache, contexts, other=(None, None)):
    reads = decode_kernel.KernelReads.of(contexts)
    return kernel.decode_attention(q.contiguous(), k_cache, v_cache, reads.slots, reads.lengths, *other)


@DTYPES
def test_kernel_is_the_attention_over_scattered_slots(kernel, dtype):
    lengths = [1, 2, 7, 8, 9, 255, 256, 257, 1031]  # tails of the 4-key tiles, the vectors, the 256-key chunks
    q, k_cache, v_cache, contexts = _paged_batch(lengths, dtype=dtype)
    out, lse = _run(kernel, q, k_cache, v_cache, contexts)  # [B, H, D] of dtype, [B, H] fp32
    assert out.dtype == dtype
    for b, slots in enumerate(contexts):
        ref, ref_lse = _reference(q[b], k_cache, v_cache, slots)
        tolerance = ref.abs().max() * TOLERANCE[dtype]
        assert float((out[b].float() - ref).abs().max()) <= tolerance, f"sequence {b} of length {lengths[b]}"
        assert torch.allclose(lse[b], ref_lse, atol=1e-4), f"sequence {b}: log-sum-exp"


@DTYPES
def test_a_part_over_other_keys_merges_into_the_attention_over_both(kernel, dtype):
    """Cascade's use: the kernel attends each row's own keys and merges a given part (a shared
    prefix's output and log-sum-exp), as one softmax over both key sets."""
    q, k_cache, v_cache, contexts = _paged_batch([40, 300, 3], seed=2, dtype=dtype)
    held = set(torch.cat(contexts).tolist())
    prefix = torch.tensor([s for s in range(k_cache.shape[0]) if s not in held][:80])  # 80 keys no context holds
    parts = [_reference(q[b], k_cache, v_cache, prefix) for b in range(len(contexts))]
    other = (torch.stack([p[0] for p in parts]).to(dtype), torch.stack([p[1] for p in parts]))
    out, lse = _run(kernel, q, k_cache, v_cache, contexts, other)
    for b, slots in enumerate(contexts):
        ref, ref_lse = _reference(q[b], k_cache, v_cache, torch.cat([prefix, slots]))
        assert float((out[b].float() - ref).abs().max()) <= ref.abs().max() * TOLERANCE[dtype], f"sequence {b}"
        assert torch.allclose(lse[b], ref_lse, atol=1e-4)


@DTYPES
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(kernel, dtype):
    q, k_cache, v_cache, contexts = _paged_batch([300, 1500, 9, 700], seed=1, dtype=dtype)
    together, _ = _run(kernel, q, k_cache, v_cache, contexts)
    for b in range(len(contexts)):
        alone, _ = _run(kernel, q[b:b + 1], k_cache, v_cache, [contexts[b]])
        assert torch.equal(alone[0], together[b])
    reversed_, _ = _run(kernel, q.flip(0), k_cache, v_cache, contexts[::-1])
    assert torch.equal(reversed_.flip(0), together)


@DTYPES
def test_readers_of_shared_documents_interleaved_get_their_bits_alone_and_the_attention(kernel, dtype):
    """Rows whose contexts begin with the same slots (readers of one document, interleaved with
    another document's readers, as a serving batch holds them) run one after the other over those
    keys: each still gets the bits it gets alone, and the attention over its context."""
    q, k_cache, v_cache, parts = _paged_batch([600, 300, 5, 9, 300, 1, 40, 7], seed=3, dtype=dtype)
    documents, own, q = parts[:2], parts[2:], q[2:]  # 600 and 300 shared keys; each row's own
    contexts = [torch.cat([documents[b % 2], slots]) for b, slots in enumerate(own)]
    together, _ = _run(kernel, q, k_cache, v_cache, contexts)
    for b, slots in enumerate(contexts):
        alone, _ = _run(kernel, q[b:b + 1], k_cache, v_cache, [slots])
        assert torch.equal(alone[0], together[b]), f"row {b}"
        ref, _ = _reference(q[b], k_cache, v_cache, slots)
        assert float((together[b].float() - ref).abs().max()) <= ref.abs().max() * TOLERANCE[dtype], f"row {b}"


def test_the_last_keys_of_a_context_score_as_in_a_group_of_four(kernel):
    """Keys past a context's last group of four are summed in the group's lane order, so a key's
    score does not change as the context grows past it. Each key's head here dots with the ones
    query to 1 in that order and to 0 in another (2^25 + 1 rounds to 2^25): all five keys score 1,
    so each value gets a fifth."""
    key = torch.zeros(DIM)
    key[0], key[4], key[16] = 2.0 ** 25, -(2.0 ** 25), 1.0
    k_cache = key.expand(8, KV_HEADS, DIM).contiguous().bfloat16()
    v_cache = torch.zeros(8, KV_HEADS, DIM)
    v_cache[torch.arange(5), :, torch.arange(5)] = 1.0  # value j: one-hot at dim j
    q = torch.ones(1, KV_HEADS * GROUP, DIM).bfloat16()
    out, lse = _run(kernel, q, k_cache, v_cache.bfloat16(), [torch.arange(5)])  # keys 0-3 a group, key 4 alone
    assert out[0, :, :5].float().unique().tolist() == [0.2001953125]  # 0.2 in bf16
    assert torch.allclose(lse, torch.full_like(lse, 1 + math.log(5)), atol=1e-5)


def test_kernel_refuses_what_it_was_not_built_for(kernel):
    q, k_cache, v_cache, contexts = _paged_batch([10])
    reads = decode_kernel.KernelReads.of(contexts)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.decode_attention(q.float(), k_cache, v_cache, reads.slots, reads.lengths)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        kernel.decode_attention(q.half(), k_cache.half(), v_cache.half(), reads.slots, reads.lengths)
    with pytest.raises(RuntimeError, match="head dim"):
        kernel.decode_attention(q[..., :32].contiguous(), k_cache[..., :32].contiguous(),
                                v_cache[..., :32].contiguous(), reads.slots, reads.lengths)
    with pytest.raises(RuntimeError, match="together"):
        kernel.decode_attention(q, k_cache, v_cache, reads.slots, reads.lengths, q)
    with pytest.raises(RuntimeError, match="length 0"):
        kernel.decode_attention(q, k_cache, v_cache, reads.slots, torch.zeros(1, dtype=torch.long))
    assert decode_kernel.supports(torch.bfloat16, 64) and decode_kernel.supports(torch.float32, 64)
    assert not decode_kernel.supports(torch.bfloat16, 16) and not decode_kernel.supports(torch.float16, 64)


def test_engine_decode_through_the_kernel_is_as_close_to_fp32_as_its_product_path(make_engine, tmp_path):
    """A bf16 model with 64-dim heads: two sequences whose blocks interleave, decoded together and
    alone, through the kernel and through the torch products; against the same model in fp32 the
    kernel's logits are as close as the products' (its scores stay fp32; the products round them
    to bf16) and its greedy tokens agree as often."""
    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engines = [make_engine(folder, num_blocks=64, dtype=dtype) for dtype in ("bfloat16", "bfloat16", "float32")]
    assert engines[0].runner.paths.kernel_decode
    engines[1].runner.paths.kernel_decode = False
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
    kernel, products, fp32 = logits
    err = {name: float((x - fp32).abs().max() / fp32.abs().max()) for name, x in (("kernel", kernel), ("products", products))}
    assert err["kernel"] <= 1.5 * err["products"] + 1e-2, err
    agree = {name: float((x.argmax(-1) == fp32.argmax(-1)).float().mean()) for name, x in (("kernel", kernel), ("products", products))}
    assert agree["kernel"] >= agree["products"] - 0.05, agree


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(decode_kernel.ENV_SWITCH, "0")
    assert decode_kernel.load() is None and not decode_kernel.supports(torch.bfloat16, 64)


def test_short_prefill_chunks_through_the_kernel_are_as_close_to_fp32_as_their_tiles(make_engine, tmp_path):
    """Packed prefill where some chunks are short enough for the kernel (a row per token, causal
    among the chunk's own tokens) and one is tiled, against every chunk tiled: as close to the
    fp32 model's logits, the same greedy tokens as the tiles."""
    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engines = [make_engine(folder, num_blocks=64, dtype=dtype) for dtype in ("bfloat16", "bfloat16", "float32")]
    engines[1].runner.paths.kernel_decode = False
    for engine in engines:  # tiles, not the flash kernel, on every CPU
        engine.runner.paths.flash_prefill = False
    chunks = [[7, 8, 9], [11], [20 + i for i in range(40)], [30 + i for i in range(8)]]
    results = []
    for engine in engines:
        ids = [engine.new_sequence() for _ in chunks]
        for n, seq in enumerate(ids):
            engine.prefill(seq, [3 + (i * (5 + n)) % 250 for i in range(60 + 30 * n)])
        logits, _ = engine.prefill_packed(ids, chunks)
        results.append(logits.float())
        for seq in ids:
            engine.free(seq)
    ours, tiles, fp32 = results
    err = {name: float((x - fp32).abs().max() / fp32.abs().max()) for name, x in (("kernel", ours), ("tiles", tiles))}
    assert err["kernel"] <= 1.5 * err["tiles"] + 1e-2, err
    assert torch.equal(ours.argmax(-1), tiles.argmax(-1))


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
    step of 12 sequences takes it (the prefix attended once for all of them, each rest and the merge
    in the kernel), and its logits are as close to fp32's as the kernel's alone; a batch without a
    shared prefix stays on the kernel."""
    from aaflow.engine.cascade import CascadeBatch
    from aaflow.engine.decode_kernel import KernelDecodeBatch

    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engines = [make_engine(folder, num_blocks=128, dtype=dtype) for dtype in ("bfloat16", "bfloat16", "float32")]
    engines[0].runner.paths.cascade_decode_batch, engines[1].runner.paths.cascade_decode_batch = 3, None
    engines[0].runner.paths.cascade_decode_min_reads = 1024  # 12 x 160 shared tokens: cascade here
    kinds, rests = [], []
    forward = engines[0].runner.model.forward
    monkeypatch.setattr(engines[0].runner.model, "forward",
                        lambda *a, **k: kinds.append(type(a[3]).__name__) or rests.append(getattr(a[3], "rest", None))
                        or forward(*a, **k))
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
    assert all(isinstance(rest, KernelDecodeBatch) for rest in rests[-6:])
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
