"""Decode of a batch in groups that share prefixes (aaflow/engine/grouped_cascade.py): each group's
prefix attended once, with the results of attending every sequence over its whole context."""

from __future__ import annotations

import torch

from aaflow.engine.grouped_cascade import GroupedCascadeBatch, prefix_groups

HEADER = [200 + i for i in range(32)]  # two blocks every sequence shares (a chat header, from the prefix cache)
DOCS = [HEADER + [3 + (i * 7 + d) % 190 for i in range(300)] for d in range(2)]  # 20 full blocks of 16 + 12 each


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_groups_are_sequences_that_begin_with_the_same_blocks_when_it_pays():
    doc_a, doc_b = list(range(18)), list(range(100, 118))
    tables = [doc_a + [200 + i] for i in range(8)] + [doc_b + [300 + i] for i in range(8)] + [[400, 401]]
    assert prefix_groups(tables, 16) == [(list(range(8)), 18), (list(range(8, 16)), 18)]  # 288 x 7 reads saved each
    assert prefix_groups(tables[:2] + tables[8:10], 16) == []  # 288 tokens x 1 other reader: too few saved
    assert prefix_groups([doc_a, doc_a[:17] + [99], [500]], 16 * 100) == [([0, 1], 17)]  # the differing block apart
    assert prefix_groups(tables[:8], 16) == []  # one group of the whole batch: plain cascade's
    header = [7]  # a block every sequence shares (a chat header): the groups are what follows it
    assert prefix_groups([header + t for t in tables], 16) == [(list(range(8)), 19), (list(range(8, 16)), 19)]


def test_a_batch_over_two_documents_decodes_as_each_sequence_alone(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=256, dtype="float32")
    seqs, prompts = [], []
    for d, doc in enumerate(DOCS):
        base = engine.new_sequence()
        engine.prefill(base, doc)
        for i in range(8):
            tail = [5 + i + d] * (1 + 3 * i)
            seq = engine.fork(base)
            engine.prefill(seq, tail)
            seqs.append(seq)
            prompts.append(doc + tail)
        engine.free(base)
    loner = engine.new_sequence()
    engine.prefill(loner, [9] * 40)
    seqs.append(loner)
    prompts.append([9] * 40)
    chosen = []
    real_decode = engine.runner.paths.decode

    def spy(*args):
        batch = real_decode(*args)
        chosen.append(type(batch))
        return batch

    engine.runner.paths.decode = spy
    tokens = list(range(11, 11 + len(seqs)))
    together = engine.decode(seqs, tokens)  # [17, vocab]
    assert chosen == [GroupedCascadeBatch]
    for s in seqs:
        engine.free(s)
    for i, prompt in enumerate(prompts):
        s = engine.new_sequence()
        engine.prefill(s, prompt, reuse_prefix=False)
        alone = engine.decode([s], [tokens[i]])[0]
        engine.free(s)
        assert rel_err(together[i], alone) <= 1e-5, f"sequence {i}"
        assert int(together[i].argmax()) == int(alone.argmax())
