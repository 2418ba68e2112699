"""The five operators on engines in one process: materialize, transfer, fork, compose, evict."""

from __future__ import annotations

import time

import pytest
import torch

import aaflow as af
from aaflow.operators import EvictionPolicy, KVHost, extend

DOC = list(range(10, 10 + 100))  # 100 tokens
QUESTION = [200, 201, 202, 203]


@pytest.fixture
def host(make_engine, tiny_llama_dir):
    h = KVHost(make_engine(tiny_llama_dir, num_blocks=128), name="a")
    yield h
    h.close()


def greedy(kv, probe, n=12):
    return af.generate(kv, probe, max_new_tokens=n, ignore_eos=True).token_ids


def recompute_greedy(host, ids, n=12):
    return host.engine.generate(ids, max_new_tokens=n, ignore_eos=True).token_ids


def test_materialize_makes_a_ref_with_lineage_and_fingerprint(host):
    kv = af.materialize(host, DOC)
    assert kv.token_ids == tuple(DOC) and kv.replica == "a" and kv.exact
    assert kv.fingerprint == host.engine.fingerprint and kv.lineage.op == "materialize"
    assert kv.nbytes == 100 * kv.spec.bytes_per_token == 100 * 2 * 2 * 2 * 16 * 4
    assert len(kv.block_table) == 7
    assert greedy(kv, QUESTION) == recompute_greedy(host, DOC + QUESTION)


def test_generate_leaves_the_context_unchanged_and_can_keep_the_continuation(host):
    kv = af.materialize(host, DOC)
    out = af.generate(kv, QUESTION, max_new_tokens=5, ignore_eos=True, keep_kv=True)
    assert out.kv.token_ids == tuple(DOC + QUESTION + out.token_ids[:-1])
    assert host.engine.sequence_tokens(host.sequence(kv)) == DOC


def test_transfer_between_engines_is_byte_identical(host, make_engine, tiny_llama_dir):
    other = KVHost(make_engine(tiny_llama_dir, num_blocks=64), name="b")
    kv = af.materialize(host, DOC)
    moved = af.transfer(kv, other)
    assert moved.replica == "b" and moved.lineage.op == "transfer"
    src = host.engine.export_kv(host.sequence(kv)).kv
    dst = other.engine.export_kv(other.sequence(moved)).kv
    assert torch.equal(src, dst)
    assert greedy(moved, QUESTION) == recompute_greedy(host, DOC + QUESTION)
    other.close()


def test_transfer_to_the_same_host_shares_blocks(host):
    kv = af.materialize(host, DOC)
    used = host.engine.stats().used
    same = af.transfer(kv, host)
    assert host.engine.stats().used == used and same.block_table == kv.block_table


def test_transfer_refuses_another_model(host, make_engine, tiny_qwen2_dir):
    qwen = KVHost(make_engine(tiny_qwen2_dir, num_blocks=16), name="q")
    kv = af.materialize(host, DOC)
    with pytest.raises(af.ModelMismatchError, match="stream the text instead"):
        af.transfer(kv, qwen)
    assert qwen.engine.stats().used == 0
    qwen.close()


def test_sixteen_forks_pay_for_one_context_plus_private_tails(host):
    kv = af.materialize(host, list(range(10, 10 + 96)))  # exactly 6 full blocks
    base = host.engine.stats().used
    forks = af.fork(kv, 16)
    assert host.engine.stats().used == base, "forks share every block"
    tails = [af.extend(f, [300 + i] * 20) for i, f in enumerate(forks)]  # 20 private tokens: 2 blocks each
    assert host.engine.stats().used == base + 16 * 2
    for i, t in enumerate(tails):  # writes after fork never change siblings
        assert t.token_ids[96:] == (300 + i,) * 20
        assert host.engine.sequence_tokens(host.sequence(forks[i])) == list(range(10, 10 + 96))
    assert greedy(tails[3], QUESTION) == recompute_greedy(host, list(range(10, 106)) + [303] * 20 + QUESTION)


def test_exact_compose_of_a_continuation_equals_one_pass_prefill(host):
    a = af.materialize(host, DOC)
    b = extend(a, QUESTION)
    c = af.compose(a, b)
    assert c.exact and c.token_ids == tuple(DOC + QUESTION)
    composed = host.engine.export_kv(host.sequence(c)).kv
    reference = af.materialize(host, DOC + QUESTION, lineage=False)
    one_pass = host.engine.export_kv(host.sequence(reference)).kv
    assert float((composed - one_pass).abs().max() / one_pass.abs().max()) <= 1e-5


def test_exact_compose_of_independent_parts_raises_and_names_the_modes(host):
    a, b = af.materialize(host, DOC), af.materialize(host, QUESTION * 5)
    with pytest.raises(af.KVComposeError, match="rerotate.*blend"):
        af.compose(a, b)


def test_rerotated_keys_equal_the_segment_computed_alone_at_the_new_offset(host):
    """Layer-0 keys depend only on token and position, so re-rotating them must land exactly on
    the keys the same segment gets when it is prefilled at the new offset."""
    a, b = af.materialize(host, DOC), af.materialize(host, QUESTION * 5)
    c = af.compose(a, b, mode="rerotate")
    assert not c.exact and c.fidelity.mode == "rerotate" and c.fidelity.total_tokens == 120
    composed = host.engine.export_kv(host.sequence(c)).kv
    full = af.materialize(host, DOC + QUESTION * 5, lineage=False)
    reference = host.engine.export_kv(host.sequence(full)).kv
    k0, k0_ref = composed[0, 0, 100:], reference[0, 0, 100:]
    assert float((k0 - k0_ref).abs().max() / k0_ref.abs().max()) <= 1e-5
    assert torch.equal(composed[:, 1, 100:], host.engine.export_kv(host.sequence(b)).kv[:, 1]), "values unchanged"


def test_blend_recomputes_the_fraction_asked_and_reports_fidelity(make_engine, tmp_path):
    """A 4-layer model: blend refreshes layers 0-1 of every moved token and all layers of r of them."""
    from tests.factories import make_tiny_model

    host = KVHost(make_engine(make_tiny_model(tmp_path, "llama", num_hidden_layers=4), num_blocks=64))
    a, b = af.materialize(host, DOC), af.materialize(host, list(range(120, 160)))
    c = af.compose(a, b, mode="blend", r=0.25, check=QUESTION)
    f = c.fidelity
    assert f.mode == "blend" and f.recomputed_tokens == 10 and not f.exact
    assert 0.0 <= f.top1_agreement <= 1.0 and f.kl_divergence > 1e-6, "25% blend is not exact"
    full = af.compose(a, b, mode="blend", r=1.0, check=QUESTION)
    assert full.fidelity.kl_divergence < 1e-6 and full.fidelity.top1_agreement == 1.0
    rerotated = af.compose(a, b, mode="rerotate", check=QUESTION)
    assert rerotated.fidelity.kl_divergence > f.kl_divergence, "blend must beat rerotate alone"
    host.close()


def test_compose_of_refs_on_different_engines_needs_a_transfer(host, make_engine, tiny_llama_dir):
    other = KVHost(make_engine(tiny_llama_dir, num_blocks=32), name="b")
    with pytest.raises(af.KVLocationError, match="transfer one of them first"):
        af.compose(af.materialize(host, DOC), af.materialize(other, QUESTION), mode="rerotate")
    other.close()


def test_evict_then_use_rebuilds_the_same_kv(host):
    kv = af.materialize(host, DOC)
    before = host.engine.export_kv(host.sequence(kv)).kv.clone()
    expected = greedy(kv, QUESTION)
    af.evict(kv)
    assert not host.is_resident(kv) and host.engine.stats().used == 0
    assert greedy(kv, QUESTION) == expected
    after = host.engine.export_kv(host.sequence(kv)).kv
    assert float((after - before).abs().max() / before.abs().max()) <= 1e-5


def test_spill_to_disk_and_reload_is_bit_exact(make_engine, tiny_llama_dir, tmp_path):
    host = KVHost(make_engine(tiny_llama_dir, num_blocks=64), spill_dir=tmp_path)
    kv = af.materialize(host, DOC)
    before = host.engine.export_kv(host.sequence(kv)).kv.clone()
    af.evict(kv, spill=True)
    assert list(tmp_path.glob("*.safetensors"))
    assert torch.equal(host.engine.export_kv(host.sequence(kv)).kv, before)
    assert not list(tmp_path.glob("*.safetensors")), "the spill file is removed once reloaded"
    host.close()


def test_evicted_ref_without_lineage_raises(host):
    kv = af.materialize(host, DOC, lineage=False)
    af.evict(kv)
    with pytest.raises(af.KVEvictedError, match="lineage disabled"):
        af.generate(kv, QUESTION)


def test_budget_eviction_keeps_the_pool_within_budget_and_spares_pinned_refs(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    budget = 14 * engine.kv_layout.block_nbytes
    host = KVHost(engine, policy=EvictionPolicy(budget_bytes=budget))
    pinned = af.materialize(host, DOC)  # 7 blocks
    af.pin(pinned)
    refs = [af.materialize(host, [i] * 64) for i in range(1, 6)]  # 4 blocks each
    assert host.used_bytes() <= budget
    assert host.is_resident(pinned), "a pinned ref is never evicted"
    assert host.is_resident(refs[-1]) and not host.is_resident(refs[0]), "least recently used goes first"
    af.unpin(pinned)
    af.generate(refs[0], QUESTION, max_new_tokens=1)  # rebuilt; now the pinned-no-more DOC is LRU
    assert host.used_bytes() <= budget and not host.is_resident(pinned)
    host.close()


def test_pin_with_ttl_expires(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64, prefix_caching=False)
    host = KVHost(engine, policy=EvictionPolicy(budget_bytes=8 * engine.kv_layout.block_nbytes))
    kv = af.materialize(host, DOC)
    af.pin(kv, ttl_s=0.0)  # an agent's tool call that already timed out
    af.materialize(host, [1] * 64)
    assert not host.is_resident(kv)
    host.close()


def test_expired_pins_are_released_into_the_prefix_cache(make_engine, tiny_llama_dir):
    """Without a budget: a pin keeps its blocks in use until its TTL runs out; `release_expired`
    then evicts the ref (its blocks stay cached for reuse) and it rebuilds on its next use."""
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    host = KVHost(engine)
    kv, other = af.materialize(host, DOC), af.materialize(host, [3] * 40)
    af.pin(kv, ttl_s=0.3)
    af.pin(other)  # no TTL: pinned until unpinned
    assert host.pinned_bytes() == kv.nbytes + other.nbytes and host.evictable_bytes() == 0
    assert host.release_expired() == []
    time.sleep(0.35)
    assert host.release_expired() == [kv.id]
    assert not host.is_resident(kv) and host.is_resident(other) and host.pinned_bytes() == other.nbytes
    assert engine.stats().cached >= len(DOC) // engine.kv_layout.block_size, "released blocks stay cached"
    assert af.generate(kv, QUESTION, max_new_tokens=2).token_ids  # rebuilt from lineage
    assert host.evictable_bytes() == kv.nbytes
    host.close()


def test_a_freed_ref_cannot_be_used(host):
    kv = af.materialize(host, DOC)
    af.free(kv)
    for use in (lambda: af.generate(kv, QUESTION), lambda: af.fork(kv, 2), lambda: af.evict(kv), lambda: af.free(kv)):
        with pytest.raises(af.KVRefFreedError, match="was freed"):
            use()
    assert host.engine.stats().used == 0


def test_bad_operator_arguments(host):
    kv = af.materialize(host, DOC)
    with pytest.raises(ValueError, match="n >= 1"):
        af.fork(kv, 0)
    with pytest.raises(af.KVComposeError, match="unknown compose mode"):
        af.compose(kv, mode="magic")
    with pytest.raises(af.PromptError):
        af.materialize(host, "")
    vocab = host.engine.config.vocab_size
    with pytest.raises(af.PromptError, match=f"token ids \\[{vocab}\\] are outside the vocabulary"):
        af.materialize(host, DOC + [vocab])
    with pytest.raises(af.KVComposeError, match=r"r must be a number in \[0, 1\]"):
        af.compose(kv, af.materialize(host, QUESTION), mode="blend", r=1.5)
    with pytest.raises(af.KVLocationError, match="needs a destination engine or KVHost"):
        af.transfer(kv, "b")
    assert greedy(kv, QUESTION) == recompute_greedy(host, DOC + QUESTION)  # nothing lost


def test_transfer_to_an_engine_uses_its_host(host, make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    kv = af.materialize(host, DOC)
    moved = af.transfer(kv, engine)
    assert moved.host is engine.kv_host and moved.host is not host
    assert torch.equal(host.engine.export_kv(host.sequence(kv)).kv, engine.export_kv(moved.host.sequence(moved)).kv)
    assert greedy(moved, QUESTION) == recompute_greedy(host, DOC + QUESTION)
    moved.host.close()


def test_approximate_kv_never_serves_prefix_cache_hits(host):
    a, b = af.materialize(host, DOC), af.materialize(host, list(range(120, 160)))
    af.compose(a, b, mode="rerotate")
    before = host.engine.stats()
    full = af.materialize(host, DOC + list(range(120, 160)))
    reused = host.engine.stats().tokens_reused - before.tokens_reused
    assert reused == 96, "only DOC's own exact blocks may be reused, never the re-rotated ones"
    assert full.exact


def test_blend_recomputes_its_anchors_first(make_engine, tmp_path):
    """Anchors (compose passes each moved segment's last token) are recomputed before any token the
    deviation ranking picks, within the same budget, and a budget of zero recomputes none."""
    from tests.factories import make_tiny_model

    engine = make_engine(make_tiny_model(tmp_path, "llama", num_hidden_layers=4), num_blocks=64)
    seq = engine.new_sequence()
    engine.prefill(seq, list(range(3, 43)))
    candidates = list(range(20, 40))
    assert engine.blend(seq, candidates, 0.05, anchors=[39]).recomputed_positions == (39,)
    picked = engine.blend(seq, candidates, 0.2, anchors=[25, 39]).recomputed_positions
    assert len(picked) == 4 and {25, 39} <= set(picked)
    assert engine.blend(seq, candidates, 0.0, anchors=[39]).recomputed_positions == ()
    engine.free(seq)
