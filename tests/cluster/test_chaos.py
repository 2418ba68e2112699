"""Chaos, short form (`aaflow bench chaos` is the long one): replica processes SIGKILLed at random
moments while workflows run under text, stream and transfer over each installed transport; every
run gives text's tokens and no KV is left behind. The replicas restart (Ray) after each kill."""

from __future__ import annotations

import aaflow as af
from aaflow.benchmarks.chaos_bench import chaos, replica_processes
from aaflow.cluster.transports import available_transports


def test_workflows_survive_random_replica_kills_with_texts_tokens(tiny_llama_dir):
    model = str(tiny_llama_dir)
    cluster = af.init(replicas={model: 3}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20, restarts=-1)
    try:
        assert len(replica_processes()) == 3
        transports = [t for t in ("ray", "nixl", "ucx") if t in available_transports()]
        doc = "Replicas die; the lineage stays. " * 6
        report = chaos(cluster, model, doc, rounds=2, interval_s=0.4, seed=1, transports=transports,
                       call_timeout_s=60, min_kills=3, targeted_rounds=2)
    finally:
        cluster.shutdown()
    assert report["kills"] >= 5, report
    # every replica is armed, the first to reach the point dies: a run whose path skips its point fires nothing
    armed, fired = (sum(v[k] for v in report["targeted_kills"].values()) for k in ("armed", "fired"))
    assert armed == 8 and fired >= 6, report["targeted_kills"]
    assert report["failures"] == [] and report["identical"] == report["runs"], report
    assert all(v == {"sessions": 0, "refs": 0, "used_blocks": 0} for v in report["leftover"].values()), report
    assert report["object_store"].get("objects") == 0, report


def test_a_run_waits_for_replicas_that_ray_is_restarting(tiny_llama_dir):
    """Every replica killed just before a run: it would find none alive; it waits for the restarts
    and gives text's tokens."""
    import os
    import signal

    model = str(tiny_llama_dir)
    cluster = af.init(replicas={model: 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20, restarts=-1)
    try:
        wf = af.Workflow("pair")
        doc = wf.context("doc", "Restarted replicas hold nothing. " * 4)
        a = wf.agent("a", model, [doc, "Summarize."], max_tokens=6, ignore_eos=True)
        wf.agent("b", model, [doc, a, "Shorter."], max_tokens=6, ignore_eos=True)
        expected = {n: r.token_ids for n, r in af.run(wf, cluster, strategy="text").agents.items()}
        for pid in replica_processes():
            os.kill(pid, signal.SIGKILL)
        res = af.run(wf, cluster, strategy="transfer", call_timeout_s=60)
        assert {n: r.token_ids for n, r in res.agents.items()} == expected
        assert any("is back" in e for e in res.events), res.events
    finally:
        cluster.shutdown()
