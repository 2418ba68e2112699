"""Options per run on one loop: runs that ask for different options share a cluster's one scheduling
loop (one KV reservation, one decode batch), and each option applies to its own run."""

from __future__ import annotations

import threading

import pytest

import aaflow as af
from aaflow.cluster.ray_backend import service_for
from tests.cluster_checks import assert_no_kv_left


@pytest.fixture(scope="module")
def one_replica(tiny_llama_dir):
    cluster = af.init(replicas={str(tiny_llama_dir): 1}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    yield cluster, str(tiny_llama_dir)
    cluster.shutdown()


def streamed_pair(model: str, name: str):
    """`up` decodes 48 tokens; `down` reads them, streamed into its prefill as they come."""
    wf = af.Workflow(name)
    up = wf.agent("up", model, ["Write at length."], max_tokens=48, ignore_eos=True)
    wf.agent("down", model, [up, "Answer."], max_tokens=4, ignore_eos=True)
    return wf


def test_runs_with_different_chunk_sizes_share_one_loop_and_keep_their_own_chunks(one_replica):
    cluster, model = one_replica
    alone = {size: {n: a.token_ids for n, a in af.run(streamed_pair(model, f"alone-{size}"), cluster,
                                                      strategy="stream", chunk_tokens=size).agents.items()}
             for size in (8, 32)}
    loop = service_for(cluster)
    backend = loop.scheduler.backend
    calls: list = []
    submit = backend.submit

    def watching(replica, call):
        calls.append(call)
        return submit(replica, call)

    backend.submit = watching
    go = threading.Barrier(2)
    results = {}

    def client(size: int) -> None:
        go.wait()
        results[size] = af.run(streamed_pair(model, f"chunks-{size}"), cluster, strategy="stream", chunk_tokens=size)

    try:
        threads = [threading.Thread(target=client, args=(size,)) for size in (8, 32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        backend.submit = submit
    assert service_for(cluster) is loop and len(cluster._run_services) == 1  # one loop whatever the options
    for size in (8, 32):
        assert {n: a.token_ids for n, a in results[size].agents.items()} == alone[size]
    run_of = {}  # loop run id -> chunk size, from the sessions of each run's `down`
    for call in calls:
        for request in call.requests:
            if "/down#" in request.sid and len(request.token_ids) < 40:  # streamed chunks, not the prompt's end
                run_of.setdefault(request.sid.split("/")[1], []).append(len(request.token_ids))
    assert len(run_of) == 2
    # between the static part (first) and the rest once `up` ended (last), each run fed its own chunks
    small, large = sorted((chunks[1:-1] for chunks in run_of.values()), key=lambda c: min(c, default=0))
    assert small and all(8 <= n < 32 for n in small), run_of
    assert large and all(n >= 32 for n in large), run_of
    steps = [call for call in calls if call.kind.steps]
    assert any(len({sid.split("/")[1] for sid in call.sessions}) == 2 for call in steps), \
        "one decode step should carry both runs' agents: they share one loop"
    assert_no_kv_left(cluster)


def test_a_run_that_keeps_its_cores_is_not_lent_threads_in_a_pack_with_one_that_lends():
    from types import SimpleNamespace

    from aaflow.runtime.agent_state import AgentState
    from aaflow.runtime.run_options import RunOptions
    from aaflow.runtime.scheduler import Scheduler

    def agent(name: str, lend: bool | None) -> AgentState:
        a = AgentState(name, "m", "text", [(1, 2, 3)], [], 4)
        a.sid, a.options = f"s/{name}", None if lend is None else RunOptions(lend_cores=lend)
        return a

    agents = {a.name: a for a in (agent("lends", True), agent("keeps", False), agent("planned", None))}
    scheduler = SimpleNamespace(state=SimpleNamespace(agents=agents))
    assert Scheduler._lends(scheduler, ["s/lends", "s/planned"])
    assert not Scheduler._lends(scheduler, ["s/lends", "s/keeps"])
    assert not Scheduler._lends(scheduler, ["s/keeps"])
    assert not Scheduler._lends(scheduler, [])  # a shared prefix's materialize: a run still on keeps its cores
    agents["keeps"].state = "done"
    assert Scheduler._lends(scheduler, [])


def test_run_options_refuse_a_call_time_limit_that_is_not_positive():
    from aaflow.runtime.run_options import RunOptions

    with pytest.raises(ValueError, match="call_timeout_s"):
        RunOptions(call_timeout_s=0)
    assert RunOptions(chunk_tokens=0).chunk_tokens == 1
