"""Decode of a batch in groups that share prefixes (aaflow/engine/grouped_cascade.py): each group's
prefix attended once, with the results of attending every sequence over its whole context; the
remainders through torch's paths or the fp32 decode kernel."""

from __future__ import annotations

import pytest
import torch

from aaflow.engine import decode_kernel
from aaflow.engine.decode_kernel import KernelDecodeBatch
from aaflow.engine.grouped_cascade import GroupedCascadeBatch, prefix_groups
from aaflow.models.tiny import make_tiny_model

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
    """The remainders through torch's paths (the tiny model's head dim has no kernel)."""
    engine = make_engine(tiny_llama_dir, num_blocks=256, dtype="float32")
    assert not engine.runner.paths.kernel_decode
    batches = _decode_two_documents_together_and_alone(engine)
    assert [type(b) for b in batches] == [GroupedCascadeBatch]


@pytest.mark.skipif(decode_kernel.load() is None, reason="no C++ compiler here: the decode kernel cannot be built")
def test_the_remainders_in_the_decode_kernel_merge_the_groups_prefixes(make_engine, tmp_path):
    """fp32 with 64-dim heads: each group's prefix attended once, the remainders read in place by
    the decode kernel, which merges the prefixes' parts; as each sequence decoded alone."""
    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engine = make_engine(folder, num_blocks=256, dtype="float32")
    assert engine.runner.paths.kernel_decode and engine.runner.paths.kernel_after_sharing
    batches = _decode_two_documents_together_and_alone(engine)
    assert [type(b) for b in batches] == [GroupedCascadeBatch]
    assert isinstance(batches[0].rest, KernelDecodeBatch)


def _decode_two_documents_together_and_alone(engine) -> list:
    """Eight forks over each of two documents and one loner decoded in one step, then each alone
    from its whole prompt: the same logits (1e-5) and tokens. Returns the step's attention batches."""
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
        chosen.append(batch)
        return batch

    engine.runner.paths.decode = spy
    tokens = list(range(11, 11 + len(seqs)))
    together = engine.decode(seqs, tokens)  # [17, vocab]
    engine.runner.paths.decode = real_decode
    for s in seqs:
        engine.free(s)
    for i, prompt in enumerate(prompts):
        s = engine.new_sequence()
        engine.prefill(s, prompt, reuse_prefix=False)
        alone = engine.decode([s], [tokens[i]])[0]
        engine.free(s)
        assert rel_err(together[i], alone) <= 1e-5, f"sequence {i}"
        assert int(together[i].argmax()) == int(alone.argmax())
    return chosen
