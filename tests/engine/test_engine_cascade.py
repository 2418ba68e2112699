"""Shared-prefix (cascade) attention: sequences that share cached blocks attend to them in one pass,
with the same results as attending sequence by sequence."""

from __future__ import annotations

import pytest
import torch

from aaflow.engine.cascade import CASCADE_MIN_SAVED_TOKENS, shared_prefix_blocks

CONTEXT = [3 + (i * 7) % 250 for i in range(300)]  # 18 full blocks of 16 + 12
FORKS = 8  # 288 shared tokens x 7 other sequences: past CASCADE_MIN_SAVED_TOKENS


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _forks(engine, n, tails):
    base = engine.new_sequence()
    engine.prefill(base, CONTEXT)
    seqs = [engine.fork(base) for _ in range(n)]
    for s, tail in zip(seqs, tails):
        engine.prefill(s, tail)
    engine.free(base)
    return seqs


def test_shared_prefix_blocks_needs_enough_saved_prefix_reads():
    assert CASCADE_MIN_SAVED_TOKENS <= 18 * 16 * (FORKS - 1)
    assert shared_prefix_blocks([list(range(20))], 16) == 0  # one sequence saves nothing
    assert shared_prefix_blocks([list(range(100))] * 2, 16) == 100  # 1,600 tokens saved once
    assert shared_prefix_blocks([list(range(20))] * 4, 16) == 0  # 320 x 3: too little to pay off
    tables = [list(range(18)) + [90 + i] for i in range(FORKS)]
    assert shared_prefix_blocks(tables, 16) == 18


def test_decoding_forks_of_one_context_equals_decoding_each_alone(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=128, dtype="float32")
    tails = [[5 + i] * (1 + 5 * i) for i in range(FORKS)]  # different lengths: padded suffixes
    seqs = _forks(engine, FORKS, tails)
    tables = [engine.runner.get(s).block_table for s in seqs]
    assert shared_prefix_blocks(tables, 16) == 18  # the cascade path is taken
    tokens = list(range(9, 9 + FORKS))
    together = engine.decode(seqs, tokens)  # [FORKS, vocab]
    for s in seqs:
        engine.free(s)
    for i, tail in enumerate(tails):
        s = engine.new_sequence()
        engine.prefill(s, CONTEXT + tail, reuse_prefix=False)
        alone = engine.decode([s], [tokens[i]])[0]
        engine.free(s)
        assert rel_err(together[i], alone) <= 1e-5, f"sequence {i}"


@pytest.mark.parametrize("lengths", ["different", "equal"])  # equal: one batched attention call
def test_packed_prefill_of_forks_equals_prefilling_each_alone(make_engine, tiny_llama_dir, lengths):
    engine = make_engine(tiny_llama_dir, num_blocks=128, dtype="float32")
    tails = [[5 + i] * (1 + 3 * i) for i in range(FORKS)]
    seqs = _forks(engine, FORKS, tails)
    sizes = [1 + 4 * i if lengths == "different" else 16 for i in range(FORKS)]  # 1 to 29 tokens, or 16 each
    segments = [list(range(100 + i, 100 + i + n)) for i, n in enumerate(sizes)]
    logits, _ = engine.prefill_packed(seqs, segments)
    kv = [engine.export_kv(s).kv for s in seqs]
    for s in seqs:
        engine.free(s)
    for i, (tail, seg) in enumerate(zip(tails, segments)):
        s = engine.new_sequence()
        alone = engine.prefill(s, CONTEXT + tail + seg, reuse_prefix=False)
        ref_kv = engine.export_kv(s).kv
        engine.free(s)
        assert rel_err(logits[i], alone) <= 1e-5, f"sequence {i}: logits"
        assert rel_err(kv[i], ref_kv) <= 1e-5, f"sequence {i}: KV"


def test_a_prefix_in_one_run_is_read_in_place_with_the_results_of_a_gather():
    from aaflow.engine.attention import AttentionBatch
    from aaflow.engine.cascade import CascadeBatch, cascade_attention
    from aaflow.engine.kv_cache import KVLayout, PagedKVCache

    cache = PagedKVCache(KVLayout(num_layers=1, num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8,
                                  dtype=torch.float32))
    cache.tensor.copy_(torch.randn(cache.layout.shape))
    run = torch.arange(8, 28)  # a 20-token prefix, consecutive
    scattered = torch.cat([torch.arange(60, 72), torch.arange(40, 48)])  # the same prefix elsewhere
    cache._flat[:, :, scattered] = cache._flat[:, :, run]
    tails = [torch.arange(100, 103), torch.arange(110, 115)]  # two sequences' own tokens, the last is new
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    rest = AttentionBatch.decode(torch.stack([t[-1] for t in tails]), tails)
    in_place, gathered = CascadeBatch(run, rest), CascadeBatch(scattered, rest)
    assert in_place.prefix_start == 8 and gathered.prefix_start is None
    torch.testing.assert_close(cascade_attention(0, q, k, v, cache, in_place),
                               cascade_attention(0, q, k, v, cache, gathered), rtol=0, atol=1e-6)


def test_leading_run_blocks_splits_off_a_long_run_before_the_new_tokens():
    from aaflow.engine.cascade import SPLIT_MIN_RUN_TOKENS, leading_run_blocks

    long_run = SPLIT_MIN_RUN_TOKENS // 16 + 2
    table = list(range(5, 5 + long_run)) + [90]
    assert leading_run_blocks(table, long_run, 16) == long_run
    assert leading_run_blocks(table, long_run - 1, 16) == long_run - 1  # never past the first new token
    assert leading_run_blocks(list(range(10)) + [90], 10, 16) == 0  # too short to pay off
    whole = list(range(long_run + 1))
    assert leading_run_blocks(whole, long_run, 16) == long_run  # a chunk: the run needs no mask
    assert leading_run_blocks(whole, long_run, 16, decode=True) == 0  # a step reads it in one pass
    broken = list(range(long_run // 2)) + [90] + list(range(long_run // 2 + 1, long_run))
    assert leading_run_blocks(broken, long_run, 16) == 0  # the run ends at block 90


def test_one_sequence_over_a_split_context_equals_one_pass(make_engine, tiny_llama_dir, monkeypatch):
    """A context whose first blocks lie in one run and whose last ones lie elsewhere (another sequence
    took the block in between): chunk prefill and decode attend to the run in place and the rest
    gathered, with the logits and KV of one-pass prefill."""
    from aaflow.engine import cascade

    monkeypatch.setattr(cascade, "SPLIT_MIN_RUN_TOKENS", 128)  # the tiny model has 512 positions
    engine = make_engine(tiny_llama_dir, num_blocks=128, dtype="float32")
    context = CONTEXT  # 18 full blocks + 12 tokens
    seq, other = engine.new_sequence(), engine.new_sequence()
    engine.prefill(seq, context)
    engine.prefill(other, [7] * 16)  # takes the block right after seq's
    tail = list(range(100, 130))
    chunk_logits = engine.prefill(seq, tail)
    table = engine.runner.get(seq).block_table
    assert table[:19] == list(range(19)) and table[19] == 20  # another sequence holds block 19
    assert cascade.leading_run_blocks(table, len(context) // 16, 16) == 18  # the split path is taken
    step_logits = engine.decode([seq], [77])[0]
    kv = engine.export_kv(seq).kv
    for s in (seq, other):
        engine.free(s)
    s = engine.new_sequence()
    alone = engine.prefill(s, context + tail, reuse_prefix=False)
    alone_step = engine.decode([s], [77])[0]
    ref_kv = engine.export_kv(s).kv
    engine.free(s)
    assert rel_err(chunk_logits, alone) <= 1e-5
    assert rel_err(step_logits, alone_step) <= 1e-5
    assert rel_err(kv, ref_kv) <= 1e-5


def test_free_blocks_are_handed_out_lowest_first():
    from aaflow.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=8, block_size=16)
    taken = [blocks.allocate() for _ in range(6)]
    for b in (4, 1, 5, 2):
        blocks.release(b)
    assert [blocks.allocate() for _ in range(4)] == [1, 2, 4, 5]  # not in release order
    assert taken == list(range(6))
