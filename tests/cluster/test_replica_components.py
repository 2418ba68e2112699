"""A replica is made of components it owns (refs, sessions, faults, calibration, transfer
endpoint, usage meter), and the default transport is one rule for `af.transfer`, `af.run` and
`af.plan`. No Ray: the replica runs in this process."""

from __future__ import annotations

import pytest

from aaflow.engine.sampling import SamplingParams
from aaflow.common.errors import KVRefFreedError
from aaflow.cluster.faults import FaultInjection
from aaflow.cluster.observed import observed
from aaflow.cluster.replica import ModelReplica
from aaflow.cluster.replica_api import default_transport
from aaflow.cluster.transports.registry import PREFERRED, available_transports, best_transport

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


def test_the_default_transport_is_the_best_available_that_every_engine_takes():
    ready = [t for t in PREFERRED if available_transports().get(t) is True]
    assert best_transport() == ready[0]
    assert default_transport({"builtin"}) == ready[0]
    assert default_transport({"builtin", "vllm"}) == "ray"  # vLLM replicas move KV over ray only


def test_a_fault_counts_down_and_strikes_once():
    faults = FaultInjection()
    faults.inject("error", 2)
    faults.maybe_fail("receive")  # not where an "error" strikes
    faults.maybe_fail("step")
    with pytest.raises(RuntimeError, match="injected"):
        faults.maybe_fail("step")
    faults.maybe_fail("step")  # disarmed after striking
    faults.inject("stale", 1)
    assert faults.stale_exposure() and not faults.stale_exposure()
    with pytest.raises(ValueError, match="unknown fault"):
        faults.inject("meteor")


def test_a_kill_claimed_by_another_replica_disarms_instead_of_striking(tmp_path):
    """Replicas armed with one claim file: the first to reach the point creates it and dies; one
    that finds it there disarms (were it to strike, it would kill this test's process)."""
    claim = tmp_path / "struck"
    claim.write_text("")  # another replica struck first
    faults = FaultInjection()
    faults.inject("kill", 1, "prefill", 0.0, str(claim))
    faults.reached("step")  # not its point: still armed
    assert faults.kill_at == ("prefill", 0.0)
    faults.reached("prefill")
    assert faults.armed is None and faults.kill_at is None and faults.claim is None


def test_replica_calls_reach_its_components_and_close_frees_everything(tiny_llama_dir):
    replica = observed(ModelReplica)("r0", str(tiny_llama_dir), dtype="float32", num_blocks=64)
    info = replica.info()
    assert (info["name"], info["engine"], info["block_size"] > 0) == ("r0", "builtin", True)
    record = replica.materialize(list(range(40)))
    assert replica.refs.get(record.id).token_ids == record.token_ids
    replica.session_open("s", fork_of=record.id)
    replica.session_prefill("s", [7, 8, 9], GREEDY)
    assert replica.session_count() == len(replica.sessions.table) == 1
    replica.inject_fault("error", 1)  # forwarded to the replica's own FaultInjection
    with pytest.raises(RuntimeError, match="injected"):
        replica.session_step(["s"])
    assert replica.faults.armed is None
    usage = replica.usage()
    assert usage["queue_depth"] == 1 and usage["calls"] >= 4 and usage["kv_bytes_held"] > 0
    replica.free(record.id)
    with pytest.raises(KVRefFreedError):
        replica.free(record.id)
    replica.close()
    assert replica.session_count() == 0 and len(replica.refs) == 0
    assert replica.engine.stats().used == 0
