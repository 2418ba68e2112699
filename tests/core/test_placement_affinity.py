"""Placement's prefix-cache affinity: agents whose prompts begin with the same tokens go where the
last of them went (its prefix cache holds those tokens), whether the document is their shared
prefix or plain text after a chat header, unless that replica is loaded by more than the bonus."""

from __future__ import annotations

from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.placement import AFFINITY_TOKENS, Placement, affinity_key
from aaflow.runtime.prompts import AgentInput

HEADER = (1, 2, 3)
DOC_A, DOC_B = tuple(range(100, 400)), tuple(range(500, 800))


def _agent(name: str, segments: list) -> AgentState:
    return AgentState(name, "m", "text", segments, [], max_tokens=4)


def _choose(placement: Placement, agent: AgentState, load: dict) -> str:
    return placement.choose(agent, sorted(load), load, {}, lambda _agent, _replica: True)


def test_the_key_reads_past_the_first_segment_up_to_an_upstream_answer():
    as_text = _agent("t", [HEADER, DOC_A + (9, 9)])  # a request whose document is plain text after the header
    as_prefix = _agent("p", [HEADER + DOC_A, (7,)])  # one whose document is its shared prefix
    assert affinity_key(as_text) == affinity_key(as_prefix) == ("m", (HEADER + DOC_A)[:AFFINITY_TOKENS])
    assert affinity_key(_agent("u", [HEADER, AgentInput("x"), DOC_A])) == ("m", HEADER)


def test_readers_of_a_document_follow_it_until_its_replica_is_loaded():
    placement = Placement()
    load = {"r0": 0, "r1": 0}
    first = _choose(placement, _agent("a", [HEADER, DOC_A]), load)
    load[first] += 1
    other = _choose(placement, _agent("b", [HEADER, DOC_B]), load)
    assert other != first  # a new document goes to the less loaded replica
    load[other] += 1
    load[first] += 1  # one more agent there: still within the bonus
    assert _choose(placement, _agent("c", [HEADER + DOC_A, (5,)]), load) == first
    load[first] += 2  # now two agents more than the other
    assert _choose(placement, _agent("d", [HEADER, DOC_A]), load) == other
