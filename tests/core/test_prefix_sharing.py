"""Shared prefixes refused for lack of KV (aaflow/runtime/prefix_sharing.py): who gets preempted."""

from __future__ import annotations

from types import SimpleNamespace

from aaflow.runtime.calls import ComposeCall, EvictCall, FreeCall, MaterializeCall, OpenCall
from aaflow.runtime.prefix_key import PlacedPrefix, PrefixKey
from aaflow.runtime.prefix_sharing import PrefixSharing
from aaflow.runtime.scheduler_state import SchedulerState


def _sharing(queues=None, **state) -> PrefixSharing:
    """PrefixSharing over a scheduler state with no replicas, its clock at 1 s."""
    backend = SimpleNamespace(replicas=lambda: [], now=lambda: 1.0)
    return PrefixSharing(SchedulerState(backend, **state), queues, "ray", forked=lambda agent, n: None)


def test_a_refused_materialize_hands_back_the_agents_waiting_for_it():
    """A prefix computed on r0 for everyone, refused there: every waiter, anywhere, is handed back.
    r1 computing it itself after its transfer failed, refused: r1's waiters only (under load these
    found no agent to preempt and failed their run)."""
    sharing = _sharing()
    prefix = PrefixKey("model", (1, 2, 3), None)
    sharing.origin[prefix] = "r0"
    at_r1, at_r2 = object(), object()
    sharing.waiters[PlacedPrefix(prefix, "r1")] = [at_r1]  # its transfer failed: r1 materializes it itself
    sharing.waiters[PlacedPrefix(prefix, "r2")] = [at_r2]  # waits for r0's copy
    assert sharing.materialize_refused("r1", [1, 2, 3]) == [at_r1]
    assert sharing.origin[prefix] == "r0" and list(sharing.waiters) == [PlacedPrefix(prefix, "r2")]
    assert sharing.materialize_refused("r0", [1, 2, 3]) == [at_r2]
    assert prefix not in sharing.origin and not sharing.waiters
    assert sharing.materialize_refused("r0", [4, 5]) == []  # nothing of the kind computed there


def test_a_composed_prefix_made_on_two_replicas_at_once_keeps_both_compositions():
    """Two failed transfers of one composed prefix: each destination composes it; a refusal on one
    abandons that one only."""
    calls = []
    queues = SimpleNamespace(call=lambda replica, call, then=None: calls.append((replica, call, then)))
    sharing = _sharing(queues)
    prefix = PrefixKey("model", (1, 2, 3), ("exact", 0, (1, 2)))
    at_r1, at_r2 = object(), object()
    sharing.waiters[PlacedPrefix(prefix, "r1")], sharing.waiters[PlacedPrefix(prefix, "r2")] = [at_r1], [at_r2]
    sharing._materialize(prefix, "r1", "first")
    sharing._materialize(prefix, "r2", "first")
    assert sharing.materialize_refused("r1", [2, 3]) == [at_r1]
    assert list(sharing.compositions.parts) == [PlacedPrefix(prefix, "r2")] and list(sharing.waiters) == [PlacedPrefix(prefix, "r2")]
    r2_calls = [c for c in calls if c[0] == "r2"]
    r2_calls[0][2](SimpleNamespace(id="a"))
    r2_calls[1][2](SimpleNamespace(id="b"))
    assert calls[-1][:2] == ("r2", ComposeCall(["a", "b"], "exact", 0))  # r2 still composes


def test_a_refused_part_of_a_composed_prefix_frees_the_parts_made_and_hands_back_its_waiters():
    calls = []
    queues = SimpleNamespace(call=lambda replica, call, then=None: calls.append((call, then)))
    sharing = _sharing(queues)
    prefix = PrefixKey("model", (1, 2, 3, 4, 5, 6), ("exact", 0, (2, 3, 1)))
    waiter = object()
    sharing.waiters[PlacedPrefix(prefix, "r0")] = [waiter]
    sharing.origin[prefix] = "r0"
    sharing._materialize(prefix, "r0", "first")
    assert [call for call, _ in calls] == [MaterializeCall([1, 2]), MaterializeCall([3, 4, 5]), MaterializeCall([6])]
    made_first, made_last = calls[0][1], calls[2][1]
    made_first(SimpleNamespace(id="part0"))
    assert sharing.materialize_refused("r0", [3, 4, 5]) == [waiter]
    assert calls[-1][0] == FreeCall("part0")  # the part made so far
    made_last(SimpleNamespace(id="part2"))  # a part that ends after the refusal is freed too
    assert calls[-1][0] == FreeCall("part2")
    assert not sharing.compositions.parts and prefix not in sharing.origin and not sharing.waiters


def test_an_evict_node_evicts_the_shared_prefix_and_a_later_fork_rebuilds_it():
    """Once every agent that shares it has forked it, the prefix is evicted on each replica that
    holds it (EvictCall: the ref stays, its blocks leave the pool), not freed; it no longer counts
    as resident; a later fork opens on the same ref (the replica rebuilds it); the end frees it."""
    calls = []
    queues = SimpleNamespace(call=lambda replica, call, then=None: calls.append((replica, call)))
    prefix = PrefixKey("model", (1, 2, 3), None)
    sharers = [SimpleNamespace(prefix_key=prefix, evicts_prefix=True, state="open", replica="r0", sid=f"s{i}",
                               prefix_via="", result=SimpleNamespace(fidelity=None)) for i in range(2)]
    sharing = _sharing(queues, agents={f"a{i}": a for i, a in enumerate(sharers)}, dead={"r2"})
    sharing.refs[prefix] = {"r0": "ref0", "r1": "ref1", "r2": "ref2"}
    sharers[1].state = "opening"
    sharing.evict_if_forked(prefix)
    assert calls == [] and sharing.resident(prefix, "r0")  # one sharer has not forked it yet
    sharers[1].state = "open"
    sharing.evict_if_forked(prefix)
    sharing.evict_if_forked(prefix)  # once only
    assert calls == [("r0", EvictCall("ref0")), ("r1", EvictCall("ref1"))]  # r2 is dead
    assert sharing.refs[prefix] == {"r0": "ref0", "r1": "ref1", "r2": "ref2"} and not sharing.resident(prefix, "r0")
    sharers[0].sid = "s0#1"  # restarted: forks the evicted ref, which the replica rebuilds
    sharing.fork_into(sharers[0], prefix)
    assert calls[-1] == ("r0", OpenCall("s0#1", "ref0")) and sharing.resident(prefix, "r0")
    sharing.free_all()
    assert calls[-2:] == [("r0", FreeCall("ref0")), ("r1", FreeCall("ref1"))] and not sharing.refs
