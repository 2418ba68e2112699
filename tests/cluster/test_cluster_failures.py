"""Operators on a cluster whose replica died or which was shut down: typed errors, nothing hangs,
and KV on the live replicas stays usable."""

from __future__ import annotations

import pytest

import aaflow as af

CONTEXT = list(range(20, 20 + 90))
QUESTION = [5, 6, 7]


def test_a_dead_replica_and_a_shut_down_cluster_raise_cluster_errors(tiny_llama_dir):
    import ray

    c = af.init(replicas={str(tiny_llama_dir): 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    try:
        a, b = c.replicas(str(tiny_llama_dir))
        kv = af.materialize(c, str(tiny_llama_dir), CONTEXT, replica=a)
        lost = af.materialize(c, str(tiny_llama_dir), CONTEXT, replica=b)
        ray.kill(b.actor)
        with pytest.raises(af.ClusterError, match=f"replica {b.name} died or was stopped"):
            af.generate(lost, QUESTION, 4)
        with pytest.raises(af.KVTransferError, match=f"{kv.id} is intact on {a.name}"):
            af.transfer(kv, b)
        recomputed = ray.get(a.actor.generate_text.remote(CONTEXT + QUESTION, 4, ignore_eos=True)).token_ids
        assert af.generate(kv, QUESTION, 4, ignore_eos=True).token_ids == recomputed
    finally:
        c.shutdown()
    with pytest.raises(af.ClusterError, match="shut down"):
        c.replicas()
    with pytest.raises(af.ClusterError, match="Ray is not running"):
        af.generate(kv, QUESTION, 4)
