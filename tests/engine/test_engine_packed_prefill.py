"""Packed prefill: several sequences' prompt segments in one forward pass, equal to one prefill each."""

from __future__ import annotations

import pytest
import torch

from aaflow.engine.attention import AttentionBatch, PackedBatch, prefill_parts
from aaflow.common.errors import KVCapacityError, PromptError

SHARED = list(range(3, 3 + 64))  # four full blocks of 16


def _kv(engine, seq):
    return engine.export_kv(seq).kv


def test_packed_prefill_equals_one_prefill_each(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    history = list(range(40, 90))
    segments = [list(range(7, 37)), list(range(100, 120)), [5]]  # a new prompt, a continuation, one token

    def fresh():
        seqs = [engine.new_sequence() for _ in segments]
        engine.prefill(seqs[1], history)
        return seqs

    alone = fresh()
    ref_logits = torch.stack([engine.prefill(s, ids) for s, ids in zip(alone, segments)])  # [3, vocab]
    packed = fresh()
    logits, reused = engine.prefill_packed(packed, segments)
    assert reused == [0, 0, 0]
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for a, p in zip(alone, packed):
        assert engine.sequence_tokens(a) == engine.sequence_tokens(p)
        assert torch.allclose(_kv(engine, a), _kv(engine, p), atol=1e-5, rtol=1e-5)
    for s in alone + packed:
        engine.free(s)


def test_continuing_chunks_of_one_length_attend_as_one_batch(make_engine, tiny_llama_dir):
    chunks = [(torch.arange(10 * b + 5, 10 * b + 8), torch.arange(10 * b, 10 * b + 3 + b), 0 + b)
              for b in range(3)]  # (write slots, context slots, start)
    merged = prefill_parts([(w, c, b + 1) for b, (w, c, _) in enumerate(chunks)])
    assert isinstance(merged, AttentionBatch) and (merged.batch, merged.q_len) == (3, 3)
    assert isinstance(prefill_parts([chunks[0], chunks[1]]), PackedBatch)  # a fresh chunk stays alone

    engine = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    histories = [list(range(40, 40 + n)) for n in (5, 23, 40, 17)]  # different context lengths
    segments = [list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]  # 8 tokens each

    def fresh():
        seqs = [engine.new_sequence() for _ in histories]
        for s, h in zip(seqs, histories):
            engine.prefill(s, h)
        return seqs

    alone = fresh()
    ref_logits = torch.stack([engine.prefill(s, ids) for s, ids in zip(alone, segments)])  # [4, vocab]
    packed = fresh()
    logits, _ = engine.prefill_packed(packed, segments)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for a, p in zip(alone, packed):
        assert torch.allclose(_kv(engine, a), _kv(engine, p), atol=1e-5, rtol=1e-5)
    for s in alone + packed:
        engine.free(s)


def test_a_prefix_shared_inside_the_pack_is_computed_once(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    prompts = [SHARED + [200 + i] * 5 for i in range(4)]
    seqs = [engine.new_sequence() for _ in prompts]
    before = engine.stats().tokens_computed
    logits, reused = engine.prefill_packed(seqs, prompts)
    assert reused == [0, 64, 64, 64]
    assert engine.stats().tokens_computed - before == 69 + 3 * 5  # not 4 x 69
    assert engine.runner.get(seqs[3]).block_table[:4] == engine.runner.get(seqs[0]).block_table[:4]
    cold = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    for row, prompt in zip(logits, prompts):
        s = cold.new_sequence()
        assert torch.allclose(row, cold.prefill(s, prompt), atol=1e-5, rtol=1e-5)
        cold.free(s)
    for s in seqs:
        engine.free(s)


def test_without_reuse_every_member_computes_its_whole_prompt(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    prompts = [SHARED + [200 + i] for i in range(3)]
    seqs = [engine.new_sequence() for _ in prompts]
    _, reused = engine.prefill_packed(seqs, prompts, [False, True, False])
    assert reused == [0, 64, 0]  # the second waits for the first's blocks; the third does not look
    for s in seqs:
        engine.free(s)


def test_packed_prefill_checks_capacity_before_changing_anything(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=6, prefix_caching=False)
    seqs = [engine.new_sequence() for _ in range(2)]
    engine.prefill(seqs[0], list(range(3, 30)))  # 2 blocks
    with pytest.raises(KVCapacityError):
        engine.prefill_packed(seqs, [list(range(50, 90)), list(range(3, 40))])  # needs 2 + 3 > 4 free
    assert len(engine.sequence_tokens(seqs[0])) == 27 and engine.sequence_tokens(seqs[1]) == []
    assert engine.stats().used == 2
    for s in seqs:
        engine.free(s)


def test_capacity_counts_a_prefix_shared_inside_the_pack_once(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=12)
    prompts = [SHARED + [200 + i] * 3 for i in range(6)]  # 4 shared blocks + 1 own block each
    seqs = [engine.new_sequence() for _ in prompts]
    _, reused = engine.prefill_packed(seqs, prompts)  # needs 4 + 6 = 10 blocks, not 6 x 5 = 30
    assert reused == [0] + [64] * 5
    assert engine.stats().used == 10
    late = engine.new_sequence()
    with pytest.raises(KVCapacityError):  # 2 free blocks: a fresh 5-block prompt does not fit
        engine.prefill_packed([late, seqs[0]], [list(range(300, 369)), [9]])
    assert engine.sequence_tokens(late) == [] and engine.stats().used == 10
    for s in seqs + [late]:
        engine.free(s)


def test_packed_prefill_rejects_bad_requests(tiny_engine):
    seq = tiny_engine.new_sequence()
    with pytest.raises(ValueError, match="twice"):
        tiny_engine.prefill_packed([seq, seq], [[1], [2]])
    with pytest.raises(PromptError, match="empty"):
        tiny_engine.prefill_packed([seq], [[]])
    with pytest.raises(ValueError, match="one token list"):
        tiny_engine.prefill_packed([seq], [[1], [2]])
    assert tiny_engine.sequence_tokens(seq) == []
    tiny_engine.free(seq)
