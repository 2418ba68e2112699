"""Admission counts a static prefix that agents on one replica share once, not once per agent
(aaflow/runtime/admission.py), and every agent's copy where they cannot share it."""

from __future__ import annotations

from aaflow.runtime.admission import Admission
from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.backend import ReplicaInfo

BLOCK = 16
PREFIX = tuple(range(2000))  # 125 full blocks
OWN = 50  # each agent's own prompt tokens


def _agent(i: int, strategy: str = "text", prefix: tuple = PREFIX) -> AgentState:
    agent = AgentState(f"a{i}", "m", strategy, [prefix, tuple(range(OWN))], [], max_tokens=16)
    agent.replica = "r0"
    return agent


def _admission(blocks: int, prefix_cache: bool = True) -> tuple[Admission, list[str]]:
    opened: list[str] = []
    replica = ReplicaInfo("r0", "m", kv_blocks=blocks, block_tokens=BLOCK, prefix_cache=prefix_cache)
    return Admission([replica], {}, set(), lambda prefix, replica: False), opened


def _own_blocks() -> int:
    """An agent's blocks beside the prefix's: prompt, output and the block a fork copies (6)."""
    return -(-(len(PREFIX) + OWN + 16) // BLOCK) + 1 - len(PREFIX) // BLOCK


def test_agents_sharing_a_prefix_reserve_it_once():
    room = 125 + 8 * _own_blocks()  # the prefix once and eight agents' own blocks; one agent alone: 131
    admission, opened = _admission(room)
    agents = [_agent(i) for i in range(8)]
    assert all(admission.admit(a) for a in agents)  # counted per agent, one of the eight fit
    assert admission.reserved["r0"] == room
    ninth = _agent(8)
    assert not admission.admit(ninth)  # no room for a ninth's own blocks: it waits
    for a in agents[:7]:  # the first holder leaves first: the prefix stays reserved for the others
        opened += [a.name for a in admission.release(a)]
    assert opened == ["a8"]  # admitted on the first release
    assert admission.reserved["r0"] == 125 + 2 * _own_blocks()
    opened += [a.name for a in admission.release(agents[7])]
    assert admission.reserved["r0"] == 125 + _own_blocks()
    opened += [a.name for a in admission.release(ninth)]
    assert admission.reserved["r0"] == 0 and not admission.prefix_holders and not admission.holds


def test_other_prefixes_and_no_reuse_count_every_copy():
    admission, _ = _admission(2 * 131)
    assert admission.admit(_agent(0)) and admission.admit(_agent(1, prefix=PREFIX[1:] + (7,)))
    assert admission.reserved["r0"] == 2 * (125 + _own_blocks())  # two prefixes: each counted

    for strategy, prefix_cache in (("text-nocache", True), ("text", False)):
        admission, _ = _admission(2 * 131, prefix_cache=prefix_cache)
        agents = [_agent(i, strategy) for i in range(3)]
        assert [admission.admit(a) for a in agents] == [True, True, False], (strategy, prefix_cache)
        assert admission.reserved["r0"] == 2 * 131 and not admission.prefix_holders
