"""Feeding an agent's prompt: which segments may be prefilled now (position-stable), and moving
its feed position forward. Upstream agents' outputs are read as they grow (streaming)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aaflow.runtime.agent_state import AgentPhase
from aaflow.runtime.prompts import AgentInput, reorder_by_completion

if TYPE_CHECKING:
    from aaflow.runtime.agent_state import AgentState


def feedable(agents: dict[str, AgentState], agent: AgentState) -> tuple[list[tuple], int, bool, int]:
    """What may be prefilled now (position-stable): (token list, start) pieces and their
    length, whether that completes the prompt, and how many of them come from upstream agents
    still decoding."""
    pieces: list[tuple] = []
    count = streamed = 0
    if agent.unordered and agent.offset == 0:
        finished = sorted((a.result.last_token_s, n) for n, a in agents.items()
                          if a.state == AgentPhase.DONE and not a.dropped)
        agent.segments = reorder_by_completion(agent.segments, agent.seg, [n for _, n in finished])
    for i in range(agent.seg, len(agent.segments)):
        seg = agent.segments[i]
        start = agent.offset if i == agent.seg else 0
        if not isinstance(seg, AgentInput):
            pieces.append((seg, start))
            count += len(seg) - start
            continue
        producer = agents[seg.agent]
        if agent.unordered and producer.state != AgentPhase.DONE and start == 0 and any(
                isinstance(s, AgentInput) for s in agent.segments[i + 1:]):
            return pieces, count, False, streamed  # another input may finish first and take this slot
        pieces.append((producer.output, start))
        count += len(producer.output) - start
        if producer.state != AgentPhase.DONE:
            streamed += len(producer.output) - start
            return pieces, count, False, streamed
    return pieces, count, True, streamed


def consume(agents: dict[str, AgentState], agent: AgentState, count: int) -> None:
    """Move the feed position `count` tokens forward."""
    agent.fed += count
    while count:
        seg = agent.segments[agent.seg]
        known = not isinstance(seg, AgentInput)
        length = len(seg) if known else len(agents[seg.agent].output)
        take = min(count, length - agent.offset)
        agent.offset += take
        count -= take
        if agent.offset == length and (known or agents[seg.agent].state == AgentPhase.DONE):
            agent.seg, agent.offset = agent.seg + 1, 0
