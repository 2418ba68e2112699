"""The simulator's mirror of `aaflow.runtime.packing`: the queued prefill calls of a replica run
as one call (one forward pass per `KVRunner.prefill_packed` wave)."""

from __future__ import annotations

from collections import deque

from aaflow.runtime.packing import PACK_MAX_TOKENS
from costmodel.sim_state import Call


def take_pack(first: Call, queue: deque) -> list[Call]:
    """`first` (an agent's prefill, kind "chunk", just taken from `queue`) and the queue's other
    ones while they add at most PACK_MAX_TOKENS tokens to compute (a first prefill computes only
    what the first taken one of its prefix does not share); the rest of the queue keeps its order."""
    taken, total, rest = [first], 0, deque()
    while queue:
        call = queue.popleft()
        led = call.shares and any(t.shares and t.prefix_key == call.prefix_key for t in taken)
        cost = call.tokens - (call.shares if led else 0)
        if call.kind == "chunk" and total + cost <= PACK_MAX_TOKENS:
            taken.append(call)
            total += cost
        else:
            rest.append(call)
    queue.extend(rest)
    return taken


def run_pack(calls: list[Call], cached: set[str], overhead_s: float, prefill_fixed_s: float) -> tuple[float, list]:
    """Evaluate each call in order, as the engine does: a member may hit prefix blocks an earlier
    member computes (the engine's second pass). Each call's seconds include one call overhead and
    one fixed prefill term; the pack pays the overhead once and the fixed term once per pass."""
    before = set(cached)
    results = [call.run() for call in calls]  # [(seconds, (computed, hit))]
    second_pass = any(out[1] and call.prefix_key not in before for call, (_, out) in zip(calls, results))
    passes = 2 if second_pass else 1
    seconds = sum(s for s, _ in results) - (len(calls) - 1) * overhead_s - (len(calls) - passes) * prefill_fixed_s
    return seconds, [value for _, value in results]
