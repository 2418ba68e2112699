"""Workflows on clusters of their own: replica faults, transfer failures, SmolLM2 end to end.

Each test starts and stops its own cluster (fault tests kill replicas), so this module must not
share Ray with a module-wide cluster.
"""

from __future__ import annotations

import pytest

import aaflow as af
from tests.frontend.test_workflow_run import chain, fan_out


@pytest.fixture
def fresh_cluster(tiny_llama_dir):
    """A cluster per test: fault tests kill replicas."""
    cluster = af.init(replicas={str(tiny_llama_dir): 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    yield cluster, str(tiny_llama_dir)
    cluster.shutdown()


@pytest.mark.parametrize("strategy", ["text", "stream", "auto"])
def test_a_replica_killed_mid_decode_is_recovered_with_identical_output(fresh_cluster, strategy):
    import ray

    cluster, model = fresh_cluster
    wf = chain(model)
    expected = {n: a.token_ids for n, a in af.run(wf, cluster, strategy="text").agents.items()}
    victim = cluster.replicas()[0]
    ray.get(victim.actor.inject_fault.remote("crash", 5))  # the process exits on its 5th decode step
    res = af.run(wf, cluster, strategy=strategy, call_timeout_s=60)
    assert {n: a.token_ids for n, a in res.agents.items()} == expected
    assert any("died" in e for e in res.events) and sum(a.restarts for a in res.agents.values()) >= 1


def test_a_replica_restarted_between_two_calls_is_recovered_with_identical_output(tiny_llama_dir):
    """Ray restarts a killed replica (empty) before the scheduler's next call reaches it: the call
    finds no session (`SessionLostError`; it was a KeyError that failed the run, seen in the chaos
    test under load); the replica counts as lost and its agents are recomputed, with text's tokens."""
    import os
    import signal
    import time

    import ray

    from aaflow.benchmarks.chaos_bench import replica_processes

    model = str(tiny_llama_dir)
    cluster = af.init(replicas={model: 1}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20, restarts=-1)
    try:
        wf = chain(model)
        expected = {n: a.token_ids for n, a in af.run(wf, cluster, strategy="text").agents.items()}
        killed: list[int] = []

        def kill_and_wait_for_the_restart(_agent, _token) -> None:  # runs in the loop, between two calls
            if killed:
                return
            killed.extend(replica_processes())
            os.kill(killed[0], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    ray.get(cluster.replicas()[0].actor.info.remote(), timeout=60)
                    return  # the restarted replica answers
                except ray.exceptions.RayActorError:
                    time.sleep(0.2)

        res = af.run(wf, cluster, strategy="text", on_token=kill_and_wait_for_the_restart, call_timeout_s=60)
        assert killed and set(replica_processes()) != set(killed)
        assert {n: a.token_ids for n, a in res.agents.items()} == expected
        assert any("died" in e for e in res.events) and sum(a.restarts for a in res.agents.values()) >= 1
    finally:
        cluster.shutdown()


def test_a_failed_transfer_falls_back_to_recompute(fresh_cluster):
    import ray

    cluster, model = fresh_cluster
    wf = fan_out(model)
    expected = {n: a.token_ids for n, a in af.run(wf, cluster, strategy="text").agents.items()}
    for r in cluster.replicas():
        ray.get(r.actor.inject_fault.remote("transfer", 5))
    res = af.run(wf, cluster, strategy="transfer")  # (auto may find recomputing the prefix as cheap)
    assert {n: a.token_ids for n, a in res.agents.items()} == expected
    assert any("recomputing instead" in e for e in res.events)


def test_a_shared_prefix_gone_with_a_restarted_replica_does_not_fail_the_finished_run(fresh_cluster, monkeypatch):
    """A replica that dies after the run's last use of a shared prefix and is restarted by Ray
    before the run frees it answers the free with KVRefFreedError (chaos test, fan_out/transfer):
    the agents' texts stand, nothing is left to free. Simulated: every free answers so after freeing."""
    from aaflow.common.errors import KVRefFreedError
    from aaflow.runtime.calls import FreeCall
    from aaflow.cluster.ray_backend import RayBackend

    cluster, model = fresh_cluster
    wf = fan_out(model)
    expected = {n: a.token_ids for n, a in af.run(wf, cluster, strategy="text").agents.items()}
    real_result = RayBackend.result

    def lost_after_free(self, ticket):
        value = real_result(self, ticket)
        if isinstance(ticket.call, FreeCall):
            raise KVRefFreedError(f"no KVRef {ticket.call.ref_id} on replica {ticket.replica}")
        return value

    monkeypatch.setattr(RayBackend, "result", lost_after_free)
    res = af.run(wf, cluster, strategy="transfer")
    assert {n: a.token_ids for n, a in res.agents.items()} == expected
    assert any("no prefix left to free" in e for e in res.events), res.events


def test_a_failing_upstream_agent_stops_its_consumers_with_a_clear_error(fresh_cluster):
    import time

    import ray

    cluster, model = fresh_cluster
    wf = chain(model)
    for r in cluster.replicas():
        ray.get(r.actor.inject_fault.remote("error", 3))
    t0 = time.perf_counter()
    with pytest.raises(af.AgentFailedError, match=r"agent\(s\) \['plan'\].*injected agent failure.*consumers \['draft'\]"):
        af.run(wf, cluster, strategy="stream", call_timeout_s=30)
    assert time.perf_counter() - t0 < 30
    for r in cluster.replicas():
        assert ray.get(r.actor.session_count.remote()) == 0, "sessions are closed after a failure"


def test_a_failed_run_leaves_no_kv_behind(fresh_cluster):
    """A run that fails after materializing its shared document frees it with its sessions: other
    runs on those replicas get the blocks back."""
    import ray

    cluster, model = fresh_cluster
    for r in cluster.replicas():
        ray.get(r.actor.inject_fault.remote("error", 3))
    with pytest.raises(af.AgentFailedError, match="injected agent failure"):
        af.run(fan_out(model), cluster, strategy="transfer", call_timeout_s=30)
    for r in cluster.replicas():
        assert ray.get(r.actor.session_count.remote()) == 0
        stats = ray.get(r.actor.stats.remote())
        assert stats["used_blocks"] == 0 and stats["refs"] == 0, f"{r.name} still holds KV of the failed run: {stats}"


@pytest.mark.smollm2
def test_smollm2_review_workflow_identical_across_strategies_in_fp32(smollm2_dir):
    from aaflow.configs import CONFIG_DIR

    wf = af.load_workflow(CONFIG_DIR / "workflows" / "review.yaml")
    cluster = af.init(replicas={"smollm2": 2}, num_cpus=2, dtype="float32")
    try:
        baseline = af.run(wf, cluster, strategy="text")
        runs = {}
        for strategy in ("transfer+stream", "auto"):
            runs[strategy] = res = af.run(wf, cluster, strategy=strategy)
            for name, agent in res.agents.items():
                assert agent.token_ids == baseline[name].token_ids, f"{strategy}/{name}: {agent.text!r}"
        shared = runs["transfer+stream"]
        assert shared.metrics["prefill_computed"] < baseline.metrics["prefill_computed"] / 3
        assert shared["meta"].streamed_tokens > 0 and shared.metrics["bytes_moved"] > 0
    finally:
        cluster.shutdown()


def test_a_step_failing_inside_a_group_of_steps_still_delivers_the_steps_before_it(fresh_cluster):
    """A lone agent decodes in groups of steps; its third step fails: the agent fails, and the two
    tokens stepped before the failure reach the run, as with one step per call."""
    import ray

    cluster, model = fresh_cluster
    wf = af.Workflow("lone")
    wf.agent("solo", model, ["Count to ten:"], max_tokens=8, ignore_eos=True)
    for r in cluster.replicas():
        ray.get(r.actor.inject_fault.remote("error", 3))
    seen = []
    with pytest.raises(af.AgentFailedError, match="injected agent failure"):
        af.run(wf, cluster, strategy="text", call_timeout_s=30, on_token=lambda name, token: seen.append(token))
    assert len(seen) == 1 + 2  # the prompt's token, then two steps
    for r in cluster.replicas():
        assert ray.get(r.actor.session_count.remote()) == 0
