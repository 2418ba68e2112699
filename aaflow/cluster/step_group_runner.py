"""Running a step group: several decode steps in one replica call (`Replica.session_steps`); how many
the scheduler asks for is `aaflow.runtime.step_groups`.

A step driven from the scheduler pays a round trip (Ray call, driver wake-up, the scheduler's
work, the next call's dispatch) on top of the forward pass. When nothing else waits for the replica, the scheduler asks for several steps at once;
the replica stops a session at its end-of-sequence token or its budget and returns after the step
in which the first session ended, so an agent's readers learn of its end as soon as with single
steps.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Sequence

from aaflow.runtime.replies import StepsReply


class StepStop(NamedTuple):
    """When a session stops decoding: after `budget` more tokens, or at a token of `eos` (empty:
    never, as with `ignore_eos`)."""

    budget: int
    eos: frozenset = frozenset()


def run_steps(step: Callable[[list[str]], list[int]], sids: Sequence[str], steps: int,
              stops: Sequence[StepStop]) -> StepsReply:
    """Up to `steps` batched decode steps of `sids` through `step` (one token per session per
    call). Returns each session's new tokens, in `sids` order, and the seconds from the call's
    start to each step's end. It ends early after a step in which a session stopped. A step that
    raises ends the call with its error; where earlier steps ran, the error carries their result
    as `partial_steps` (their KV is written: the scheduler takes their tokens, then handles the
    error as it would after single steps)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    if len(stops) != len(sids):
        raise ValueError(f"one StepStop per session: {len(sids)} sessions, {len(stops)} stops")
    start = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in sids]
    ends: list[float] = []
    for _ in range(steps):
        try:
            new = step(list(sids))
        except Exception as exc:
            if ends:
                exc.partial_steps = StepsReply(tokens, ends)
            raise
        ends.append(time.perf_counter() - start)
        stopped = False
        for out, token, stop in zip(tokens, new, stops):
            out.append(token)
            stopped |= len(out) >= stop.budget or token in stop.eos
        if stopped:
            break
    return StepsReply(tokens, ends)
