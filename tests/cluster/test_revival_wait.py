"""Waiting for a restarting replica does not hold the loop: while no replica of one model lives
(Ray is restarting it), the runs of another model go on, and the waiting run resumes once the
replica is back, with the tokens it gives undisturbed."""

from __future__ import annotations

import threading
import time

import aaflow as af
from aaflow.cluster.ray_backend import service_for


def one_agent(model: str, name: str):
    wf = af.Workflow(name)
    wf.agent("answer", model, ["Say something short."], max_tokens=6, ignore_eos=True)
    return wf


def test_a_run_waiting_for_a_restarting_replica_does_not_stall_other_models_runs(tiny_llama_dir, tiny_qwen2_dir):
    llama, qwen = str(tiny_llama_dir), str(tiny_qwen2_dir)
    cluster = af.init(replicas={llama: 1, qwen: 1}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20,
                      restarts=-1)
    try:
        expected = {m: af.run(one_agent(m, "alone"), cluster, strategy="text")["answer"].token_ids for m in (llama, qwen)}
        loop = service_for(cluster)
        backend = loop.scheduler.backend
        down = next(r.name for r in cluster.replicas() if r.model == llama)
        back = threading.Event()
        revived = backend.revived
        # Ray "restarting" the llama replica until `back` is set: the loop sees it lost, not yet revived
        backend.revived = lambda replica, timeout_s: (True if back.is_set() else False) if replica == down \
            else revived(replica, timeout_s)
        loop.scheduler.state.dead.add(down)  # the loop is idle between runs: nothing in flight on it
        waiting = af.start(one_agent(llama, "waits"), cluster, strategy="text")
        t0 = time.perf_counter()
        other = af.run(one_agent(qwen, "goes-on"), cluster, strategy="text")
        other_s = time.perf_counter() - t0
        assert not waiting.done()  # still waiting for its replica
        back.set()
        res = waiting.result(timeout=60)
        backend.revived = revived
    finally:
        cluster.shutdown()
    assert other_s < 20, f"the other model's run took {other_s:.1f} s: the loop waited for the restart"
    assert other["answer"].token_ids == expected[qwen]
    assert res["answer"].token_ids == expected[llama]
    assert any("waits for a replica" in e for e in res.events) and any("is back" in e for e in res.events), res.events
