"""Packed prefill chunks over cached prefixes, attended per prefix group (prefix_groups.py): each
member's causal attention over its context, in fp32 to float rounding and in bf16 within its
rounding; which chunks form a group; and an engine's pack of forks of two documents against the
flash kernel's paths."""

from __future__ import annotations

import pytest
import torch

from aaflow.engine import prefix_groups as pg
from tests.engine.test_engine_tiled_attention import reference, rel_err, tiles_against_flash


def _contexts(shared: torch.Tensor, members: list[tuple[int, int]], first_own: int) -> list[torch.Tensor]:
    """Slot lists: the `shared` slots, then each member's own (start - shared earlier, T new) elsewhere."""
    out, slot = [], first_own
    for T, start in members:
        own = start + T - shared.numel()
        out.append(torch.cat([shared, torch.arange(slot, slot + own)]))
        slot += own + 3
    return out


@pytest.mark.parametrize("scattered", [False, True])
def test_a_group_gives_each_members_causal_attention(scattered):
    torch.manual_seed(5)
    k_cache, v_cache = torch.randn(900, 2, 16), torch.randn(900, 2, 16)
    shared = torch.randperm(300)[:120] if scattered else torch.arange(40, 160)  # prefix slots, in place or gathered
    members = [(5, 130), (17, 120), (1, 150), (9, 121)]  # (new tokens, start): own keys before the new ones too
    contexts = [torch.arange(600, 640)] + _contexts(shared, members, 400)  # an unrelated fresh chunk first
    starts = [0] + [s for _, s in members]
    offsets = [0]
    for context, start in zip(contexts, starts):
        offsets.append(offsets[-1] + context.numel() - start)
    q = torch.randn(offsets[-1], 6, 16)
    group = pg.PrefixGroup.build([1, 2, 3, 4], contexts, starts, offsets, shared.numel())
    assert group.prefix_run == (None if scattered else 40)
    out = group.attend(q, k_cache, v_cache)
    refs = torch.cat([reference(q[offsets[i]:offsets[i + 1]], k_cache[contexts[i]], v_cache[contexts[i]], starts[i])
                      for i in range(1, 5)])
    assert torch.equal(group.rows, torch.arange(offsets[1], offsets[-1]))
    assert rel_err(out, refs) <= 1e-5
    bf16 = pg.PrefixGroup.build([1, 2, 3, 4], contexts, starts, offsets, shared.numel())
    out = bf16.attend(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), refs) <= 3e-2


def test_chunks_group_by_the_cached_prefix_they_continue(monkeypatch):
    monkeypatch.setattr(pg, "GROUP_MIN_TOKENS", 8)
    doc_a, doc_b = torch.arange(0, 40), torch.arange(100, 140)
    contexts = [torch.cat([doc_a, torch.arange(200, 205)]), torch.cat([doc_b, torch.arange(210, 214)]),
                torch.cat([doc_a[:30], torch.arange(220, 236)]), torch.cat([doc_b, torch.arange(240, 242)]),
                torch.arange(300, 340), torch.cat([doc_a[:10], torch.arange(250, 290)])]
    starts = [40, 40, 30, 40, 0, 45]
    offsets = [0]
    for context, start in zip(contexts, starts):
        offsets.append(offsets[-1] + context.numel() - start)
    groups, alone = pg.prefix_groups(list(range(6)), contexts, starts, offsets)
    assert sorted((g.members, g.prefix.numel()) for g in groups) == [([0, 2, 5], 10), ([1, 3], 40)]
    assert alone == [4]  # a fresh prompt attends alone
    monkeypatch.setattr(pg, "GROUP_MIN_TOKENS", 11)  # doc_a's three share only 10 slots
    groups, alone = pg.prefix_groups(list(range(6)), contexts, starts, offsets)
    assert [g.members for g in groups] == [[1, 3]] and alone == [0, 2, 4, 5]


def test_engine_pack_of_forks_of_two_documents_gives_the_flash_path_logits(make_engine, tiny_llama_dir, monkeypatch):
    """fp32, tiles forced on: a pack of chunks over two cached documents (forks of each) and a
    fresh prompt attends each document's chunks as a group, with the flash kernel's logits."""
    monkeypatch.setattr(pg, "GROUP_MIN_TOKENS", 64)
    built, engines = tiles_against_flash(make_engine, tiny_llama_dir, monkeypatch, flash=False, num_blocks=128)
    docs = [[3 + (i * 7) % 250 for i in range(150)], [5 + (i * 11) % 250 for i in range(100)]]
    results = []
    for engine in engines:
        parents = [engine.new_sequence() for _ in docs]
        for parent, doc in zip(parents, docs):
            engine.prefill(parent, doc)
        forks = [engine.fork(parents[n % 2]) for n in range(5)]
        fresh = engine.new_sequence()
        logits, _ = engine.prefill_packed(forks + [fresh], [[9 + n] * (3 + 9 * n) for n in range(5)] + [[4] * 30])
        results.append(logits)
        for s in parents + forks + [fresh]:
            engine.free(s)
    grouped = [b for b in built if b.groups]
    assert sorted(len(g.members) for g in grouped[-1].groups) == [2, 3]
    assert rel_err(results[0], results[1]) <= 1e-5
