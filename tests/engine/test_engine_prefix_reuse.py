"""Prefix-cache reuse on sequences that already hold tokens: a session forked from a document's ref
adopts the cached blocks that continue it, alone or inside a pack, and gives what recomputing
the whole prompt from text gives."""

from __future__ import annotations

import torch

DOC = list(range(3, 3 + 70))  # four full blocks of 16 and 6 tokens into the fifth
SUFFIX = [200 + i for i in range(40)]  # ends 110 tokens in: the sixth block full, 14 tokens into the seventh


def _ref(engine):
    """The document's sequence, as a materialized ref holds it."""
    doc = engine.new_sequence()
    engine.prefill(doc, DOC)
    return doc


def _prefill_counting(engine, seq, **kwargs):
    """`engine.prefill(seq, SUFFIX)`'s logits and how many tokens it computed."""
    before = engine.stats().tokens_computed
    logits = engine.prefill(seq, SUFFIX, **kwargs)
    return logits, engine.stats().tokens_computed - before


def _recomputed(tiny_llama_dir, make_engine, prompt):
    cold = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    seq = cold.new_sequence()
    try:
        return cold.prefill(seq, prompt), cold.export_kv(seq).kv
    finally:
        cold.free(seq)


def test_a_fork_reuses_the_blocks_an_earlier_fork_computed_for_the_same_words(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    doc = _ref(engine)
    first, second = engine.fork(doc), engine.fork(doc)
    engine.prefill(first, SUFFIX)
    logits, computed = _prefill_counting(engine, second)
    # cached blocks cover positions up to 96: the fifth block (the doc's partial one, replaced) and the sixth
    assert computed == 110 - 96
    assert engine.sequence_tokens(second) == DOC + SUFFIX
    assert engine.runner.get(second).block_table[4:6] == engine.runner.get(first).block_table[4:6]
    assert engine.runner.get(second).block_table[:4] == engine.runner.get(doc).block_table[:4]
    expected_logits, expected_kv = _recomputed(tiny_llama_dir, make_engine, DOC + SUFFIX)
    assert torch.allclose(logits, expected_logits, atol=1e-5, rtol=1e-5)
    assert torch.allclose(engine.export_kv(second).kv, expected_kv, atol=1e-5, rtol=1e-5)
    assert engine.sequence_tokens(doc) == DOC  # the ref's own partial block is untouched
    for s in (doc, first, second):
        engine.free(s)


def test_forks_with_the_same_words_in_one_pack_compute_them_once(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    doc = _ref(engine)
    forks = [engine.fork(doc) for _ in range(3)]
    before = engine.stats().tokens_computed
    logits, reused = engine.prefill_packed(forks, [SUFFIX] * 3)
    assert reused == [0, 96 - 70, 96 - 70]
    assert engine.stats().tokens_computed - before == 40 + 2 * (110 - 96)  # not 3 x 40
    expected_logits, _ = _recomputed(tiny_llama_dir, make_engine, DOC + SUFFIX)
    for row in logits:
        assert torch.allclose(row, expected_logits, atol=1e-5, rtol=1e-5)
    for s in [doc] + forks:
        engine.free(s)


def test_a_fork_of_approximate_kv_never_adopts_cached_blocks(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    exact = _ref(engine)
    earlier = engine.fork(exact)
    engine.prefill(earlier, SUFFIX)  # caches DOC + SUFFIX's blocks
    approx = engine.import_kv(engine.export_kv(exact), cacheable=False)
    fork = engine.fork(approx)
    assert _prefill_counting(engine, fork)[1] == len(SUFFIX)
    for s in (exact, earlier, approx, fork):
        engine.free(s)


def test_without_reuse_a_fork_computes_its_words(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    doc = _ref(engine)
    earlier, fork = engine.fork(doc), engine.fork(doc)
    engine.prefill(earlier, SUFFIX)
    assert _prefill_counting(engine, fork, reuse_prefix=False)[1] == len(SUFFIX)
    for s in (doc, earlier, fork):
        engine.free(s)
