"""How many decode steps one replica call runs (`StepsCall`, `cluster.multi_step`).

One step per call pays a round trip and the scheduler's work per step (a lone SmolLM2 sequence on
two cores: 28 ms a token in a workflow against 20 ms a step in the engine; a 4-agent chain took
5.76 s with single steps, 5.07 s in groups, medians of 4; raising the cap from 8 to 32 tokens a
group, at most 8 steps: 8 A->B pairs 4.95 to 4.70 s, map-reduce 3.47 to 3.39 s, one replica on a
Xeon with AMX, medians of 4 alternated); several steps per call hold back
whatever reaches the replica meanwhile (a prompt segment queued behind them waits for the group to
end). So a group is sent only when the replica's queue is empty and no decoding agent feeds a
streaming reader (those want each chunk as soon as it is decoded); it decodes at most
`GROUP_TOKENS` tokens in all and `GROUP_STEPS` steps (a small batch, whose steps are short and
whose round trips weigh most, gets the longest groups; a batch of `GROUP_TOKENS / 2` sessions or
more steps once per call, except on a run's only replica when every agent ignores end-of-sequence:
see `steps_per_call`) and never runs past the first agent's budget (its end frees its readers at once). The count depends on the
schedule's state only, not on measured times, so a run and its simulation issue the same calls.
"""

from __future__ import annotations

GROUP_TOKENS = 32  # tokens a group of steps decodes at most, over all its sessions
GROUP_STEPS = 8  # steps a group runs at most


def steps_per_call(decoding: list, streaming_readers: dict, only_replica: bool = False) -> int:
    """Decode steps the next call of a replica may run for `decoding`, its decoding agents (none
    with a prompt segment queued). On the `only_replica` of a run, when every decoding agent
    ignores end-of-sequence, nothing can reach the replica before the first of them reaches its
    budget (no other replica's agent can end, none of these ends early), so the group runs up to
    that point, at most `GROUP_STEPS` steps, whatever the batch."""
    for agent in decoding:
        if any(reader.state != "done" for reader in streaming_readers[agent.name]):
            return 1
    budget = min(agent.max_tokens - agent.result.decoded for agent in decoding)
    if only_replica and all(agent.ignore_eos for agent in decoding):
        return max(1, min(budget, GROUP_STEPS))
    if len(decoding) >= GROUP_TOKENS:
        return 1
    return max(1, min(budget, GROUP_STEPS, GROUP_TOKENS // len(decoding)))


def stops(decoding: list, eos: dict) -> list[tuple[int, frozenset]]:
    """Each decoding agent's `cluster.multi_step.StepStop` as a plain tuple: tokens left in its
    budget, and its model's end-of-sequence ids unless it ignores them."""
    return [(agent.max_tokens - agent.result.decoded,
             frozenset() if agent.ignore_eos else frozenset(eos[agent.model])) for agent in decoding]
