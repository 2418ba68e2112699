"""Admission that knows the graph (aaflow/runtime/admission.py): a reader of a prefix resident on
its replica goes before older agents that would bring a new prefix, and the oldest waiting agent is
overtaken only `MAX_PASSES` times."""

from __future__ import annotations

from aaflow.runtime import admission as admission_module
from aaflow.runtime.admission import Admission
from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.backend import ReplicaInfo

BLOCK = 16
DOC_P = tuple(range(1600))  # 100 full blocks
DOC_Q = tuple(range(1, 1601))
OWN = 40


def _agent(name: str, doc: tuple) -> AgentState:
    agent = AgentState(name, "m", "text", [doc, tuple(range(OWN))], [], max_tokens=16)
    agent.replica = "r0"
    return agent


def _admission(blocks: int) -> tuple[Admission, list[str]]:
    opened: list[str] = []
    replica = ReplicaInfo("r0", "m", kv_blocks=blocks, block_tokens=BLOCK, prefix_cache=True)
    return Admission([replica], {}, set(), lambda prefix, replica: False), opened


def _own(admission: Admission, agent: AgentState) -> int:
    return admission.blocks(agent, "r0") - admission.shared_blocks(agent, "r0")


def test_a_reader_of_a_resident_prefix_goes_before_an_older_agent_needing_a_new_one():
    probe = _agent("probe", DOC_P)
    admission, opened = _admission(0)
    own = _own(admission, probe)
    admission, opened = _admission(100 + 3 * own)  # document P and three agents' own blocks
    p1 = _agent("p1", DOC_P)
    assert admission.admit(p1)
    q1 = _agent("q1", DOC_Q)  # older, but its document is not there and does not fit beside P
    assert not admission.admit(q1)
    p2 = _agent("p2", DOC_P)  # reads the resident P: only its own blocks, admitted at once
    assert admission.admit(p2)
    assert admission.passes == {"q1": 1}
    p3 = _agent("p3", DOC_P)
    assert admission.admit(p3)
    p4 = _agent("p4", DOC_P)  # no room even for its own blocks: waits behind q1
    assert not admission.admit(p4)
    assert [a.name for a in admission.waiting["r0"]] == ["q1", "p4"]
    opened += [a.name for a in admission.release(p1)]  # room for p4's own blocks, not for Q: the reader goes first
    assert opened == ["p4"]
    for agent in (p2, p3, p4):
        opened += [a.name for a in admission.release(agent)]
    assert opened == ["p4", "q1"]  # P gone: Q fits, q1 was never dropped from the queue
    opened += [a.name for a in admission.release(q1)]
    assert admission.reserved["r0"] == 0 and not admission.passes


def test_the_oldest_waiting_agent_is_overtaken_a_bounded_number_of_times(monkeypatch):
    monkeypatch.setattr(admission_module, "MAX_PASSES", 3)
    probe = _agent("probe", DOC_P)
    admission, _ = _admission(0)
    own = _own(admission, probe)
    admission, opened = _admission(100 + 5 * own)  # room for P, p0 and four readers; Q does not fit
    admission.admit(_agent("p0", DOC_P))
    q1 = _agent("q1", DOC_Q)
    assert not admission.admit(q1)
    readers = [_agent(f"p{i}", DOC_P) for i in range(1, 5)]
    admitted = [admission.admit(r) for r in readers]
    assert admitted == [True, True, True, False]  # the fourth reader waits: q1 was passed three times
    assert [a.name for a in admission.waiting["r0"]] == ["q1", "p4"]


def test_without_a_resident_prefix_the_queue_keeps_its_order():
    probe = _agent("probe", DOC_P)
    admission, _ = _admission(0)
    own = _own(admission, probe)
    admission, opened = _admission(100 + 2 * own)
    p1 = _agent("p1", DOC_P)
    assert admission.admit(p1)
    q1, r1 = _agent("q1", DOC_Q), _agent("r1", tuple(range(2, 1602)))
    assert not admission.admit(q1) and not admission.admit(r1)  # neither document is there
    opened += [a.name for a in admission.release(p1)]
    assert opened == ["q1"] and [a.name for a in admission.waiting["r0"]] == ["r1"]


def test_the_last_holder_of_a_prefix_hands_it_to_its_waiting_reader_before_the_queue():
    """A workflow's next reader of a document (b reads it once a has ended) waits for a's room; when
    a ends, b takes the document over before an older agent that would evict it for another."""
    probe = _agent("probe", DOC_P)
    admission, _ = _admission(0)
    own = _own(admission, probe)
    admission, opened = _admission(100 + own + 1)  # P and one agent's own blocks (and a block)
    a = _agent("a", DOC_P)
    assert admission.admit(a)
    q1 = _agent("q1", DOC_Q)  # older than b: waits, Q does not fit beside P
    assert not admission.admit(q1)
    b = _agent("b", DOC_P)  # opened as a ends, before a's release: no room for its own blocks yet
    assert not admission.admit(b)
    opened += [x.name for x in admission.release(a)]
    assert opened == ["b"]  # with P released first, q1 would have fit and b would have recomputed P
    assert [x.name for x in admission.waiting["r0"]] == ["q1"]
    opened += [x.name for x in admission.release(b)]
    assert opened == ["b", "q1"] and admission.reserved["r0"] == admission.blocks(q1, "r0")
