"""How many decode steps one replica call runs (`StepsCall`, `aaflow.cluster.step_group_runner`).

One step per call pays a round trip and the scheduler's work per step, a sizeable part of a small
batch's step (measured: docs/RESULTS-history.md, "Figures moved out of code comments"); several
steps per call hold back whatever reaches the replica meanwhile (a prompt segment queued behind
them, a run another client submits, waits for the group to end). So a group is sent only when the
replica's queue is empty and no decoding agent feeds a streaming reader (those want each chunk as
soon as it is decoded); it decodes at most `GROUP_TOKENS` tokens in all and `GROUP_STEPS` steps (a
small batch, whose steps are short and whose round trips weigh most, gets the longest groups; a
batch of `GROUP_TOKENS` sessions or more steps once per call, where a round trip is a small part
of a step: docs/RESULTS.md, "Where a burst's time goes") and never runs past the first agent's
budget. Whatever the agents' end-of-sequence settings: the replica stops a session at its
end-of-sequence token inside the group and returns after that step (its end frees its readers at
once). The count depends on the schedule's state only, not on measured times, so a run and its
simulation issue the same calls.
"""

from __future__ import annotations

from aaflow.runtime.agent_state import AgentPhase

GROUP_TOKENS = 32  # tokens a group of steps decodes at most, over all its sessions
GROUP_STEPS = 8  # steps a group runs at most


def steps_per_call(decoding: list, streaming_readers: dict) -> int:
    """Decode steps the next call of a replica may run for `decoding`, its decoding agents (none
    with a prompt segment queued)."""
    for agent in decoding:
        if any(reader.state != AgentPhase.DONE for reader in streaming_readers[agent.name]):
            return 1
    budget = min(agent.max_tokens - agent.result.decoded for agent in decoding)
    if len(decoding) >= GROUP_TOKENS:
        return 1
    return max(1, min(budget, GROUP_STEPS, GROUP_TOKENS // len(decoding)))


def stops(decoding: list, eos: dict) -> list[tuple[int, frozenset]]:
    """Each decoding agent's `aaflow.cluster.step_group_runner.StepStop` as a plain tuple: tokens left in its
    budget, and its model's end-of-sequence ids unless it ignores them."""
    return [(agent.max_tokens - agent.result.decoded,
             frozenset() if agent.ignore_eos else frozenset(eos[agent.model])) for agent in decoding]
