"""Shared-prefix (cascade) attention: sequences that share cached blocks attend to them in one pass,
with the same results as attending sequence by sequence."""

from __future__ import annotations

import torch

from aaflow.engine.cascade import CASCADE_MIN_TOKENS, shared_prefix_blocks

CONTEXT = [3 + (i * 7) % 250 for i in range(300)]  # 18 full blocks of 16 + 12: past CASCADE_MIN_TOKENS


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


def test_shared_prefix_blocks_needs_two_tables_and_a_long_prefix():
    assert shared_prefix_blocks([[1, 2, 3] * 10], 16) == 0
    assert shared_prefix_blocks([list(range(20)), list(range(20))], 16) == 20
    assert shared_prefix_blocks([list(range(20)), list(range(10)) + [99] * 10], 16) == 0  # 160 tokens: too short
    assert CASCADE_MIN_TOKENS <= 18 * 16
    assert shared_prefix_blocks([list(range(20)), list(range(18)) + [98, 99]], 16) == 18


def test_decoding_forks_of_one_context_equals_decoding_each_alone(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=96, dtype="float32")
    tails = [[5], [6, 7, 8], list(range(40, 60))]  # different lengths: padded suffixes
    seqs = _forks(engine, 3, tails)
    tables = [engine.runner.get(s).block_table for s in seqs]
    assert shared_prefix_blocks(tables, 16) == 18  # the cascade path is taken
    together = engine.decode(seqs, [9, 10, 11])  # [3, vocab]
    for s in seqs:
        engine.free(s)
    for i, tail in enumerate(tails):
        s = engine.new_sequence()
        engine.prefill(s, CONTEXT + tail, reuse_prefix=False)
        alone = engine.decode([s], [9 + i])[0]
        engine.free(s)
        assert rel_err(together[i], alone) <= 1e-5, f"sequence {i}"


def test_packed_prefill_of_forks_equals_prefilling_each_alone(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=96, dtype="float32")
    seqs = _forks(engine, 3, [[5], [6, 7], [8] * 20])
    segments = [list(range(100, 117)), [4], list(range(60, 90))]
    logits, _ = engine.prefill_packed(seqs, segments)
    kv = [engine.export_kv(s).kv for s in seqs]
    for s in seqs:
        engine.free(s)
    for i, (tail, seg) in enumerate(zip([[5], [6, 7], [8] * 20], segments)):
        s = engine.new_sequence()
        alone = engine.prefill(s, CONTEXT + tail + seg, reuse_prefix=False)
        ref_kv = engine.export_kv(s).kv
        engine.free(s)
        assert rel_err(logits[i], alone) <= 1e-5, f"sequence {i}: logits"
        assert rel_err(kv[i], ref_kv) <= 1e-5, f"sequence {i}: KV"
