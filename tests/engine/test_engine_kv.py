"""The paged KV pool: chunked prefill, batched decode, prefix cache, fork/COW, export/import."""

from __future__ import annotations

import pytest
import torch

PROMPT = list(range(3, 3 + 200))  # 200 tokens: 12 full blocks of 16 + 8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prefill_and_export(engine, ids, chunk_size=None):
    seq = engine.new_sequence()
    logits = engine.prefill(seq, ids, chunk_size=chunk_size)
    kv = engine.export_kv(seq).kv
    engine.free(seq)
    return logits, kv


@pytest.mark.parametrize("chunk", [1, 7, 16, 128])
def test_chunked_prefill_equals_one_pass(make_engine, tiny_llama_dir, chunk):
    engine = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    ref_logits, ref_kv = prefill_and_export(engine, PROMPT)
    logits, kv = prefill_and_export(engine, PROMPT, chunk_size=chunk)
    assert rel_err(logits, ref_logits) <= 1e-5, f"chunk {chunk}: logits differ"
    assert rel_err(kv, ref_kv) <= 1e-5, f"chunk {chunk}: exported KV differs"


def test_incremental_prefill_appends_at_next_positions(tiny_engine):
    one = tiny_engine.new_sequence()
    ref = tiny_engine.prefill(one, PROMPT)
    two = tiny_engine.new_sequence()
    tiny_engine.prefill(two, PROMPT[:50])
    tiny_engine.prefill(two, PROMPT[50:123])
    out = tiny_engine.prefill(two, PROMPT[123:])
    assert tiny_engine.sequence_tokens(two) == PROMPT
    assert rel_err(out, ref) <= 1e-5
    tiny_engine.free(one)
    tiny_engine.free(two)


def test_batched_decode_equals_decoding_alone(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 90)]
    alone = [engine.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in prompts]
    batched = engine.generate_batch(prompts, params=_greedy(20))
    assert [o.token_ids for o in batched] == alone
    # and the logits themselves, one step on sequences of different lengths
    seqs = [engine.new_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        engine.prefill(s, p)
    together = engine.decode(seqs, [7] * len(seqs))  # [B, vocab]
    for s in seqs:
        engine.free(s)
    for i, p in enumerate(prompts):
        s = engine.new_sequence()
        engine.prefill(s, p)
        single = engine.decode([s], [7])[0]
        engine.free(s)
        assert rel_err(together[i], single) <= 1e-5, f"sequence {i} of length {len(p)}"


def _greedy(n):
    from aaflow.engine import SamplingParams

    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_prefix_cache_hit_computes_only_new_tokens(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    first = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    before = engine.stats()
    assert before.used == 0 and before.cached >= len(PROMPT) // 16
    question = PROMPT + [9, 8, 7, 6, 5]
    second = engine.generate(question, max_new_tokens=12, ignore_eos=True)
    after = engine.stats()
    reusable = (len(question) - 1) // 16 * 16  # full blocks of the shared prefix
    assert second.num_reused_tokens == reusable == 192
    # prefill computed only the tokens past the cached blocks, then 11 decode steps
    assert after.tokens_computed - before.tokens_computed == len(question) - reusable + 11
    cold = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    assert second.token_ids == cold.generate(question, max_new_tokens=12, ignore_eos=True).token_ids
    assert first.token_ids == cold.generate(PROMPT, max_new_tokens=12, ignore_eos=True).token_ids


def test_prefix_cache_reuses_blocks_of_a_sequence_still_in_flight(tiny_engine):
    running = tiny_engine.new_sequence()
    tiny_engine.prefill(running, PROMPT)  # not freed: still in flight
    shared_block = tiny_engine.runner.get(running).block_table[0]
    other = tiny_engine.new_sequence()
    tiny_engine.prefill(other, PROMPT[:100] + [1, 2, 3])
    assert tiny_engine.runner.get(other).block_table[:6] == tiny_engine.runner.get(running).block_table[:6]
    assert tiny_engine.runner.blocks.ref_counts[shared_block] == 2
    tiny_engine.free(running)
    tiny_engine.free(other)


def test_fork_then_divergent_continuations_equal_independent_runs(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    base = engine.new_sequence()
    engine.prefill(base, PROMPT)  # 200 tokens: the last block is partial, so writes copy it
    used_before = engine.stats().used
    child = engine.fork(base)
    assert engine.stats().used == used_before, "fork must not allocate: memory is paid once"
    outs = engine.generate_batch([[11, 12], [40, 41, 42]], params=_greedy(10), seq_ids=[base, child], keep=True)
    for s in (base, child):
        engine.free(s)
    for out, tail in zip(outs, ([11, 12], [40, 41, 42])):
        alone = engine.generate(PROMPT + tail, max_new_tokens=10, ignore_eos=True)
        assert out.token_ids == alone.token_ids


def test_copy_on_write_keeps_the_parent_intact(tiny_engine):
    parent = tiny_engine.new_sequence()
    tiny_engine.prefill(parent, PROMPT)
    before = tiny_engine.export_kv(parent).kv.clone()
    child = tiny_engine.fork(parent)
    tiny_engine.prefill(child, [1] * 30)  # writes into the shared partial block -> copied first
    assert tiny_engine.runner.get(child).block_table[-3] != tiny_engine.runner.get(parent).block_table[-1]
    assert torch.equal(tiny_engine.export_kv(parent).kv, before)
    tiny_engine.free(parent)
    tiny_engine.free(child)


def test_export_import_continue_equals_continuing_the_original(tiny_engine):
    src = tiny_engine.new_sequence()
    tiny_engine.prefill(src, PROMPT)
    export = tiny_engine.export_kv(src)
    assert export.kv.shape == (2, 2, len(PROMPT), 2, 16) and export.nbytes == export.kv.numel() * 4
    copy = tiny_engine.import_kv(export)
    assert tiny_engine.sequence_tokens(copy) == PROMPT
    a = tiny_engine.prefill(src, [5, 6, 7])
    b = tiny_engine.prefill(copy, [5, 6, 7])
    assert torch.equal(a, b), "imported KV must continue bit-for-bit like the original"
    assert torch.equal(tiny_engine.decode([src], [9]), tiny_engine.decode([copy], [9]))
    tiny_engine.free(src)
    tiny_engine.free(copy)


def test_import_into_another_engine_of_the_same_model(tiny_engine, make_engine, tiny_llama_dir):
    other = make_engine(tiny_llama_dir, num_blocks=32)
    src = tiny_engine.new_sequence()
    tiny_engine.prefill(src, PROMPT)
    dst = other.import_kv(tiny_engine.export_kv(src))
    assert torch.equal(tiny_engine.prefill(src, [5]), other.prefill(dst, [5]))
    tiny_engine.free(src)
    other.free(dst)


def test_stats_count_blocks_and_tokens(tiny_engine):
    start = tiny_engine.stats()
    s = tiny_engine.new_sequence()
    tiny_engine.prefill(s, list(range(40)))
    mid = tiny_engine.stats()
    assert mid.used - start.used == 3 and mid.free == mid.num_blocks - mid.used
    assert mid.tokens_computed - start.tokens_computed == 40
    tiny_engine.free(s)
    assert tiny_engine.stats().used == 0


@pytest.mark.parametrize("slots", [
    list(range(40, 117)),                                     # one run
    list(range(0, 200)) + list(range(300, 420)) + list(range(200, 230)),  # runs out of order
    [5, 90, 3, 17, 64, 2, 33, 48],                             # fragmented: falls back to a gather
    list(range(0, 512, 2)),                                    # every other slot: a gather too
])
def test_read_and_write_tokens_by_runs_equal_slot_by_slot(slots):
    from aaflow.engine.kv_cache import KVLayout, PagedKVCache, slot_runs

    cache = PagedKVCache(KVLayout(num_layers=3, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=4,
                                  dtype=torch.bfloat16))
    cache.tensor.copy_(torch.randn(cache.layout.shape))
    index = torch.tensor(slots)
    assert sum(n for _, _, n in slot_runs(index)) == len(slots)
    flat = cache.tensor.view(3, 2, 512, 2, 4)
    assert torch.equal(cache.read_tokens(index), flat.index_select(2, index))
    kv = torch.randn(3, 2, len(slots), 2, 4).to(torch.bfloat16)
    before = flat.clone()
    cache.write_tokens(index, kv)
    assert torch.equal(flat.index_select(2, index), kv)
    untouched = torch.ones(512, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(flat[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("q_len", [1, 5])
def test_attention_reads_one_run_of_slots_in_place_and_equals_a_gather(q_len):
    from aaflow.engine.attention import AttentionBatch, paged_attention
    from aaflow.engine.kv_cache import KVLayout, PagedKVCache

    cache = PagedKVCache(KVLayout(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8,
                                  dtype=torch.float32))
    cache.tensor.copy_(torch.randn(cache.layout.shape))
    ctx = 23
    run = torch.arange(17, 17 + ctx)  # consecutive: read as views of the pool
    scattered = torch.cat([torch.arange(40, 52), torch.arange(4, 15)])  # the same context elsewhere: gathered
    cache._flat[:, :, scattered] = cache._flat[:, :, run]
    q, k, v = torch.randn(q_len, 4, 8), torch.randn(q_len, 2, 8), torch.randn(q_len, 2, 8)

    def attend(context):
        if q_len == 1:
            batch = AttentionBatch.decode(context[-1:], [context])
        else:
            batch = AttentionBatch.prefill(context[-q_len:], context, ctx - q_len)
        return batch, paged_attention(1, q, k, v, cache, batch)

    in_place, out = attend(run)
    gathered, expected = attend(scattered)
    assert in_place.read_start == 17 and gathered.read_start is None
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_folds_query_groups_with_the_results_of_enable_gqa(dtype):
    import torch.nn.functional as F

    from aaflow.engine.attention import AttentionBatch, paged_attention, write_and_gather
    from aaflow.engine.kv_cache import KVLayout, PagedKVCache

    cache = PagedKVCache(KVLayout(num_layers=1, num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype))
    cache.tensor.copy_(torch.randn(cache.layout.shape))
    contexts = [torch.arange(3, 30), torch.arange(60, 71)]  # two sequences of different lengths: padded, masked
    q, k, v = (torch.randn(2, h, 8, dtype=dtype) for h in (6, 2, 2))  # one new token each, 3 query heads per kv head
    batch = AttentionBatch.decode(torch.stack([c[-1] for c in contexts]), contexts)
    out = paged_attention(0, q, k, v, cache, batch)  # [2, 6 * 8]
    qh, kh, vh = write_and_gather(0, q, k, v, cache, batch)  # [2, 6, 1, 8], [2, 2, 27, 8]
    expected = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=batch.mask, enable_gqa=True)  # [2, 6, 1, 8]
    assert batch.mask is not None
    torch.testing.assert_close(out, expected.reshape(2, -1), rtol=0, atol=1e-6 if dtype == torch.float32 else 0)
