"""Decode attention read in place run by run (run_attention.py): the results of the flash kernel
over the gathered context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aaflow.engine import run_attention
from aaflow.engine.run_attention import (ContextPieces, attend_pieces, own_heads, reads_in_place_pays,
                                         scaled_block_queries)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_context_pieces_keep_long_runs_in_place_and_gather_the_rest():
    slots = torch.cat([torch.arange(100, 200), torch.arange(7, 12), torch.arange(300, 364), torch.tensor([2])])
    pieces = ContextPieces.of(slots)
    assert pieces.runs == [(100, 100), (300, 64)]
    assert pieces.gathered.tolist() == [7, 8, 9, 10, 11, 2]
    assert ContextPieces.of(torch.arange(5, 9)).runs == [] and ContextPieces.of(torch.arange(5, 9)).gathered.numel() == 4


def _attend(q: torch.Tensor, pieces, num_kv_heads: int) -> torch.Tensor:  # q: [N, H, D] -> [N, H, D]
    qbd = scaled_block_queries(q, num_kv_heads)  # [N, H, Hkv * D]
    out = torch.empty_like(qbd)
    for n in range(q.shape[0]):
        attend_pieces(qbd[n], pieces, out[n])
    return own_heads(out, num_kv_heads).view(q.shape)


def _sdpa(q, keys, values):  # q: [N, H, D]; keys, values: [ctx, Hkv, D]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], enable_gqa=True)  # [1, H, N, D]
    return ref[0].transpose(0, 1)


def test_attend_pieces_equals_attention_over_the_joined_keys():
    torch.manual_seed(0)
    q = torch.randn(2, 6, 16)  # 2 queries, 6 heads, 2 kv heads (groups of 3)
    keys, values = torch.randn(3, 50, 2, 16), torch.randn(3, 50, 2, 16)  # 3 pieces of 50 tokens
    pieces = [(k.reshape(50, 32), v.reshape(50, 32)) for k, v in zip(keys, values)]
    out = _attend(q, pieces, num_kv_heads=2)
    assert rel_err(out, _sdpa(q, keys.reshape(150, 2, 16), values.reshape(150, 2, 16))) <= 1e-5


def test_in_place_reads_chosen_for_one_sequence_and_for_many_long_private_contexts():
    private = [[i * 300 + b for b in range(200)] for i in range(16)]
    assert reads_in_place_pays([100], [[0]], 16)  # one sequence: always
    assert reads_in_place_pays([4096] * 8, private[:8], 16)  # 32k tokens in long contexts, none shared
    assert not reads_in_place_pays([2048] * 16, private, 16)  # shorter contexts: gathering wins
    assert not reads_in_place_pays([1024] * 32, private * 2, 16)
    assert reads_in_place_pays([2100] * 32, private * 2, 16)  # too much to gather
    assert not reads_in_place_pays([2048] * 16, [list(range(200))] * 16, 16)  # shared: cascade


@pytest.mark.parametrize("in_place", [True, False], ids=["runs-in-place", "gathered-products"])
def test_decode_as_products_gives_the_logits_of_the_gathered_flash_path(make_engine, tiny_llama_dir, monkeypatch,
                                                                          in_place):
    """Two sequences whose blocks interleave (each context is a long run and scattered blocks), decoded
    together and alone, in fp32 with the product paths on (reads in place, or the gathered batch's
    products), against the flash path."""
    threshold = 1 if in_place else 10**9
    monkeypatch.setattr(run_attention, "LONG_CONTEXT_TOKENS", threshold)
    monkeypatch.setattr(run_attention, "MANY_CONTEXT_TOKENS", threshold)
    batches = []
    monkeypatch.setattr(run_attention.GatheredDecodeBatch, "build", _recorded(run_attention.GatheredDecodeBatch.build,
                                                                             batches))
    engines = [make_engine(tiny_llama_dir, num_blocks=64, dtype="float32") for _ in range(2)]
    engines[0].runner.paths.run_decode, engines[1].runner.paths.run_decode = True, False
    logits = []
    for engine in engines:
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.prefill(a, [3 + (i * 7) % 250 for i in range(150)])
        engine.prefill(b, [5 + (i * 11) % 250 for i in range(90)])
        steps = [engine.decode([a, b], [10 + i, 20 + i]) for i in range(20)]  # grows both: blocks interleave
        steps += [engine.decode([a], [40 + i]) for i in range(5)]
        assert len(ContextPieces.of(engine.runner.kv_slots(a)).runs) >= 1
        assert ContextPieces.of(engine.runner.kv_slots(a)).gathered is not None
        logits.append(steps)
        engine.free(a)
        engine.free(b)
    for step, (ours, ref) in enumerate(zip(*logits)):
        assert rel_err(ours, ref) <= 1e-5, f"step {step}"
    assert (len(batches) == 0) == in_place  # two sequences of unequal lengths: padded
    assert all(b.padding is not None for b in batches)


def _recorded(build, into: list):
    def wrapper(*args):
        into.append(build(*args))
        return into[-1]
    return staticmethod(wrapper)
