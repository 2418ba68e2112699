"""The cluster's one scheduling loop: many runs from many threads, batched, cancelled, timed out, failed alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import aaflow as af
from aaflow.runtime.calls import CallKind
from aaflow.cluster.ray_backend import service_for
from tests.cluster_checks import assert_no_kv_left
from tests.frontend.test_workflow_run import chain, fan_out, map_reduce


@pytest.fixture(scope="module")
def one_replica(tiny_llama_dir):
    cluster = af.init(replicas={str(tiny_llama_dir): 1}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    yield cluster, str(tiny_llama_dir)
    cluster.shutdown()


def long_run(model: str, name: str = "long", tokens: int = 400):
    wf = af.Workflow(name)
    wf.agent("talk", model, ["Talk at length."], max_tokens=tokens, ignore_eos=True)
    return wf


def _renamed(build, model: str, i: int):
    wf = build(model)
    wf.name = f"{wf.name}-{i}"
    return wf


def test_runs_from_many_threads_are_batched_together_and_keep_their_tokens(one_replica):
    cluster, model = one_replica
    builds = [chain, fan_out, map_reduce]
    alone = {b.__name__: {n: a.token_ids for n, a in af.run(b(model), cluster, strategy="text").agents.items()}
             for b in builds}
    backend = service_for(cluster).scheduler.backend
    batches: list[set[str]] = []
    submit = backend.submit

    def watching(replica, call):  # which runs a decode step carries
        if call.kind.steps:
            batches.append({sid.split("/")[1] for sid in call.sessions})
        return submit(replica, call)

    backend.submit = watching
    try:
        with ThreadPoolExecutor(max_workers=12) as pool:
            results = list(pool.map(lambda i: (builds[i % 3].__name__, af.run(_renamed(builds[i % 3], model, i),
                                                                                cluster, strategy="text")), range(12)))
    finally:
        backend.submit = submit
    for name, res in results:
        assert {n: a.token_ids for n, a in res.agents.items()} == alone[name], name
        assert res.wall_s > 0 and all(a.first_token_s >= 0 for a in res.agents.values())
    assert max(len(runs) for runs in batches) >= 4, "decode steps should carry the agents of several runs"
    assert_no_kv_left(cluster)


def test_cancel_frees_the_run_and_the_others_finish(one_replica):
    cluster, model = one_replica
    expected = {n: a.token_ids for n, a in af.run(chain(model), cluster, strategy="text").agents.items()}
    decoding = threading.Event()
    handle = af.start(long_run(model, tokens=440), cluster, strategy="text", on_token=lambda *_: decoding.set())
    other = af.start(chain(model), cluster, strategy="text")
    assert decoding.wait(60)  # in flight (a run that ended already could not be cancelled)
    t0 = time.perf_counter()
    handle.cancel()
    with pytest.raises(af.RunCancelledError, match="cancelled"):
        handle.result(timeout=60)
    assert time.perf_counter() - t0 < 10
    assert {n: a.token_ids for n, a in other.result(timeout=120).agents.items()} == expected
    assert_no_kv_left(cluster)


def test_a_run_past_its_timeout_ends_and_frees_its_kv(one_replica):
    cluster, model = one_replica
    with pytest.raises(af.RunCancelledError, match="timeout"):
        af.run(long_run(model, tokens=440), cluster, strategy="text", timeout_s=0.2)
    assert_no_kv_left(cluster)


def test_a_callback_that_raises_fails_only_its_own_run(one_replica):
    cluster, model = one_replica
    expected = {n: a.token_ids for n, a in af.run(fan_out(model), cluster, strategy="text").agents.items()}

    def broken(agent, token):
        raise ValueError("client bug")

    with ThreadPoolExecutor(max_workers=2) as pool:
        bad = pool.submit(af.run, chain(model), cluster, strategy="text", on_token=broken)
        good = pool.submit(af.run, fan_out(model), cluster, strategy="text")
        with pytest.raises(ValueError, match="client bug"):
            bad.result(timeout=120)
        assert {n: a.token_ids for n, a in good.result(timeout=120).agents.items()} == expected
    assert_no_kv_left(cluster)


TIE_S = 0.05  # ends closer than this are one step's


def test_runs_admitted_oldest_first_when_the_pool_is_short(tiny_llama_dir):
    """A pool that holds about one run at a time: runs queue in admission, start in arrival order,
    and none waits behind later ones (no starvation)."""
    cluster = af.init(replicas={str(tiny_llama_dir): 1}, num_cpus=2, dtype="float32", num_blocks=40)
    try:
        model = str(tiny_llama_dir)
        expected = {n: a.token_ids for n, a in af.run(chain(model), cluster, strategy="text").agents.items()}
        handles = []
        for i in range(6):
            handles.append((time.perf_counter(), af.start(_renamed(chain, model, i), cluster, strategy="text")))
            time.sleep(0.05)  # arrival order
        ended = []
        for called, h in handles:
            res = h.result(timeout=300)
            assert {n: a.token_ids for n, a in res.agents.items()} == expected
            ended.append(called + res.total_s)  # when its result was handed over
        # runs that finish in one step are handed over a few ms apart in either order: that is a tie
        late = [(i, round(a - b, 3)) for i, (a, b) in enumerate(zip(ended, ended[1:])) if b < a - TIE_S]
        assert not late, f"a later run finished before an earlier one (index, seconds): {late}"
        assert_no_kv_left(cluster)
    finally:
        cluster.shutdown()


def test_on_token_streams_each_runs_own_tokens(one_replica):
    cluster, model = one_replica
    streamed: dict[str, list[int]] = {}
    lock = threading.Lock()

    def collect(run: str):
        def on_token(agent, token):
            with lock:
                streamed.setdefault(f"{run}/{agent}", []).append(token)
        return on_token

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {i: pool.submit(af.run, _renamed(chain, model, i), cluster, strategy="text", on_token=collect(str(i)))
                   for i in range(3)}
        results = {i: f.result(timeout=120) for i, f in futures.items()}
    for i, res in results.items():
        for name, agent in res.agents.items():
            assert streamed[f"{i}/{name}"] == agent.token_ids


def test_calls_of_a_stopped_service_are_refused(tiny_llama_dir):
    cluster = af.init(replicas={str(tiny_llama_dir): 1}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    service = service_for(cluster)
    cluster.shutdown()
    assert service._stopped
    with pytest.raises(af.AAFlowError, match="stopped"):
        service.submit(chain(str(tiny_llama_dir)), {}, {}, {}, "text")
    assert CallKind.CLOSE.bookkeeping


@pytest.mark.smollm2
def test_smollm2_burst_from_threads_completes_with_each_workflows_own_tokens(smollm2_dir):
    """The serving benchmark's load, small: every workflow completes with the tokens it gives alone."""
    from aaflow.benchmarks.serve_shapes import documents, serve_workflows

    workflows = serve_workflows(12, documents(3, 200), 8)
    cluster = af.init(replicas={"smollm2": 1}, num_cpus=2, dtype="float32", kv_cache_bytes=64 * 2**20)
    try:
        alone = {wf.name: {n: a.token_ids for n, a in af.run(wf, cluster, strategy="auto").agents.items()}
                 for wf in workflows[:3]}
        with ThreadPoolExecutor(max_workers=len(workflows)) as pool:
            results = list(pool.map(lambda wf: af.run(wf, cluster, strategy="auto"), workflows))
        for i, res in enumerate(results):
            assert {n: a.token_ids for n, a in res.agents.items()} == alone[f"serve-{i % 3}"], res.workflow
        assert_no_kv_left(cluster)
    finally:
        cluster.shutdown()


def _sim_scheduler(model: str):
    """A scheduler on the simulated clock with one replica of `model`; its backend; prompt builders."""
    from aaflow.runtime import prompt_builders
    from aaflow.runtime.scheduler import Scheduler
    from aaflow.runtime.sim_backend import SimBackend
    from aaflow.costmodel.hardware import ComputeProfile, HardwareProfile, LinkProfile
    from aaflow.costmodel.model_profile import ModelProfile

    compute = ComputeProfile(0.005, 1e-4, 1e-8, 0.02, 1e-4, 1e-7)
    hardware = HardwareProfile("test-box", False, "hand-built", 2e10, {"tiny": compute}, {"ray": LinkProfile(5e9)})
    backend = SimBackend([("r0", model)], hardware, {model: ModelProfile.from_folder("tiny", model, dtype="float32")},
                         "ray", 0.002)
    builders, eos, _ = prompt_builders({model})
    return Scheduler({}, backend, eos), backend, builders


def test_an_agent_started_over_while_its_session_opens_closes_that_session_and_runs_on_its_new_one(tiny_llama_dir):
    """On the simulated clock (its replica, like a real one, fails a call on an unknown session): an
    agent restarted (preempted, gated) while its OpenCall is in flight. That open's answer closes the
    old session and sends nothing for it; the agent runs to its end on its new session."""
    from aaflow.runtime.agent_state import namespaced
    from aaflow.runtime.calls import OpenCall
    from aaflow.runtime.executor import workflow_agents

    model = str(tiny_llama_dir)
    scheduler, backend, builders = _sim_scheduler(model)
    agents = namespaced(workflow_agents(chain(model), builders, "text"), "x/")
    scheduler.add(agents)
    first = next(a for a in agents.values() if a.state != "new")
    scheduler.launch()
    old = first.sid
    assert any(isinstance(t.call, OpenCall) and t.call.sid == old for t in scheduler.queues.inflight)
    scheduler.restart(first, gate=True)
    assert first.sid != old
    while scheduler.launch():
        scheduler.process(backend.wait(list(scheduler.queues.inflight), 1, 1.0)[0])
    assert scheduler.unfinished == 0
    assert all(a.state == "done" and a.result.decoded == a.max_tokens for a in agents.values())
    assert not backend.sims["r0"].sessions  # the old session was closed too


def test_a_run_dropped_while_its_prompt_is_in_flight_stays_ended(tiny_llama_dir):
    """On the simulated clock: a run ended while its prompt segment runs ignores that segment's answer
    (it does not start decoding); the other run finishes and nothing is counted twice."""
    from aaflow.runtime.agent_state import namespaced
    from aaflow.runtime.executor import workflow_agents

    model = str(tiny_llama_dir)
    scheduler, backend, builders = _sim_scheduler(model)
    ended, going = (namespaced(workflow_agents(chain(model), builders, "text"), tag) for tag in ("x/", "y/"))
    scheduler.add(ended)
    scheduler.add(going)

    def in_flight(agents) -> bool:
        sids = {a.sid for a in agents.values()}
        return any(t.call.kind.prefills and sids & set(t.call.sessions) for t in scheduler.queues.inflight)

    while scheduler.launch() and not in_flight(ended):
        scheduler.process(backend.wait(list(scheduler.queues.inflight), 1, 1.0)[0])
    assert in_flight(ended)
    scheduler.drop(list(ended.values()))
    while scheduler.launch():
        scheduler.process(backend.wait(list(scheduler.queues.inflight), 1, 1.0)[0])
    assert scheduler.unfinished == 0
    assert all(a.dropped and not a.output for a in ended.values())
    assert all(a.state == "done" and len(a.output) == a.result.decoded for a in going.values())
    assert not any(scheduler.state.decoding.values())


def test_keep_prefix_s_keeps_a_shared_prefix_for_the_next_run_then_frees_it(one_replica):
    """A run's shared prefix (transfer: materialized once, forked) stays after it ends for
    `keep_prefix_s`; a run in that window forks it (nothing of it computed again); then it goes."""
    import ray

    cluster, model = one_replica
    replica = cluster.replicas()[0]
    ray.get(replica.actor.clear_prefix_cache.remote())
    first = af.run(fan_out(model), cluster, strategy="transfer", keep_prefix_s=3.0)
    assert ray.get(replica.actor.stats.remote())["refs"] == 1, "the shared prefix was freed at the run's end"
    again = af.run(fan_out(model), cluster, strategy="transfer")
    assert again.metrics["shared_prefill_computed"] == 0 < first.metrics["shared_prefill_computed"]
    assert {n: a.token_ids for n, a in again.agents.items()} == {n: a.token_ids for n, a in first.agents.items()}
    deadline = time.time() + 10
    while ray.get(replica.actor.stats.remote())["refs"] and time.time() < deadline:
        time.sleep(0.2)
    assert_no_kv_left(cluster)
    with pytest.raises(af.InvalidArgumentError, match="keep_prefix_s"):
        af.start(fan_out(model), cluster, keep_prefix_s=-1)


def test_a_kept_prefix_goes_as_soon_as_an_agent_waits_for_kv_room(one_replica, monkeypatch):
    """A keep only uses room nobody wants: while an agent waits for KV room, the loop frees the
    kept prefixes no pending agent reads, however long their keep."""
    import ray

    cluster, model = one_replica
    replica, scheduler = cluster.replicas()[0], service_for(cluster).scheduler
    af.run(fan_out(model), cluster, strategy="transfer", keep_prefix_s=600.0)
    assert ray.get(replica.actor.stats.remote())["refs"] == 1
    monkeypatch.setattr(scheduler, "room_wanted", lambda: True)  # as when an agent's KV does not fit yet
    af.run(chain(model), cluster, strategy="text")  # wakes the loop
    assert ray.get(replica.actor.stats.remote())["refs"] == 0
    assert not service_for(cluster).kept
    assert_no_kv_left(cluster)


def test_a_bug_in_the_loop_outside_a_call_fails_the_run_instead_of_hanging_it(one_replica, monkeypatch):
    """Handing results is outside the replica calls' error handling: a bug there ends the runs with
    it, and the loop serves the next run."""
    cluster, model = one_replica
    scheduler = service_for(cluster).scheduler
    monkeypatch.setattr(scheduler, "forget", lambda agents: (_ for _ in ()).throw(RuntimeError("bug in forget")))
    with pytest.raises(RuntimeError, match="bug in forget"):
        af.start(chain(model), cluster, strategy="text").result(timeout=120)
    monkeypatch.undo()
    assert af.run(chain(model), cluster, strategy="text")["final"].token_ids
