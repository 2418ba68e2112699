"""How many decode steps one replica call runs (`StepsCall`, `cluster.step_group_runner`).

One step per call pays a round trip and the scheduler's work per step, a sizeable part of a small
batch's step (measured: docs/RESULTS-history.md, "Figures moved out of code comments"); several
steps per call hold back whatever reaches the replica meanwhile (a prompt segment queued behind them waits for the group to
end). So a group is sent only when the replica's queue is empty and no decoding agent feeds a
streaming reader (those want each chunk as soon as it is decoded); it decodes at most
`GROUP_TOKENS` tokens in all and `GROUP_STEPS` steps (a small batch, whose steps are short and
whose round trips weigh most, gets the longest groups; a batch of `GROUP_TOKENS / 2` sessions or
more steps once per call, except on a run's only replica when every agent ignores end-of-sequence:
see `steps_per_call`) and never runs past the first agent's budget (its end frees its readers at once). The count depends on the
schedule's state only, not on measured times, so a run and its simulation issue the same calls.
"""

from __future__ import annotations

from aaflow.runtime.agent_state import AgentPhase

GROUP_TOKENS = 32  # tokens a group of steps decodes at most, over all its sessions
GROUP_STEPS = 8  # steps a group runs at most


def steps_per_call(decoding: list, streaming_readers: dict, only_replica: bool = False) -> int:
    """Decode steps the next call of a replica may run for `decoding`, its decoding agents (none
    with a prompt segment queued). On the `only_replica` of a run, when every decoding agent
    ignores end-of-sequence, nothing can reach the replica before the first of them reaches its
    budget (no other replica's agent can end, none of these ends early), so the group runs up to
    that point, at most `GROUP_STEPS` steps, whatever the batch."""
    for agent in decoding:
        if any(reader.state != AgentPhase.DONE for reader in streaming_readers[agent.name]):
            return 1
    budget = min(agent.max_tokens - agent.result.decoded for agent in decoding)
    if only_replica and all(agent.ignore_eos for agent in decoding):
        return max(1, min(budget, GROUP_STEPS))
    if len(decoding) >= GROUP_TOKENS:
        return 1
    return max(1, min(budget, GROUP_STEPS, GROUP_TOKENS // len(decoding)))


def stops(decoding: list, eos: dict) -> list[tuple[int, frozenset]]:
    """Each decoding agent's `cluster.step_group_runner.StepStop` as a plain tuple: tokens left in its
    budget, and its model's end-of-sequence ids unless it ignores them."""
    return [(agent.max_tokens - agent.result.decoded,
             frozenset() if agent.ignore_eos else frozenset(eos[agent.model])) for agent in decoding]
