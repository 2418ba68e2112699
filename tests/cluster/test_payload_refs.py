"""Payload refs (the vLLM replica's KV objects) evict, spill, reload and rebuild without vLLM:
here the rebuild is the built-in engine's export of the same tokens."""

from __future__ import annotations

import pytest
import torch

import aaflow as af
from aaflow.cluster.payload_refs import PayloadRefs


@pytest.fixture
def refs_and_engine(tiny_engine):
    def rebuild(ids):
        seq = tiny_engine.new_sequence()
        try:
            tiny_engine.prefill(seq, ids)
            return tiny_engine.export_kv(seq)
        finally:
            tiny_engine.free(seq)

    refs = PayloadRefs("test-replica", tiny_engine.fingerprint, rebuild)
    yield refs, rebuild
    refs.clear()


def test_evict_rebuilds_and_spill_reloads_bit_exact(refs_and_engine):
    refs, rebuild = refs_and_engine
    payload = rebuild(list(range(5, 45)))
    refs.add("r1", payload)
    refs.evict("r1", spill=True)
    assert not refs.is_resident("r1")
    assert refs.get("r1").kv.equal(payload.kv) and refs.get("r1").token_ids == payload.token_ids
    refs.evict("r1")
    again = refs.get("r1")
    assert torch.allclose(again.kv, payload.kv, atol=1e-6) and refs.is_resident("r1")


def test_lineage_disabled_cannot_be_rebuilt_and_freed_refs_are_gone(refs_and_engine):
    refs, rebuild = refs_and_engine
    refs.add("orphan", rebuild([7, 8, 9]), lineage=False)
    refs.evict("orphan")
    with pytest.raises(af.KVEvictedError, match="lineage disabled"):
        refs.get("orphan")
    refs.add("spilled", rebuild([7, 8, 9]))
    refs.evict("spilled", spill=True)
    refs.free("spilled")
    refs.free("orphan")
    assert len(refs) == 0
    with pytest.raises(af.KVRefFreedError, match="spilled"):
        refs.get("spilled")
    with pytest.raises(af.KVRefFreedError):
        refs.free("spilled")


def test_spilled_kv_of_another_model_is_refused(refs_and_engine):
    refs, rebuild = refs_and_engine
    refs.add("r", rebuild([3, 4, 5]))
    refs.evict("r", spill=True)
    refs.fingerprint = "another-model"
    with pytest.raises(af.KVImportError, match="another model"):
        refs.get("r")
