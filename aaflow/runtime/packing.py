"""Packing the queued prompt segments of several agents on one replica into one call.

A replica runs one call at a time. When several agents on it wait to prefill (prompts of agents
that start together, streamed chunks of upstream output), each segment alone would read the
model's weights once for a handful of tokens; packed, one forward pass reads them once for all
(`KVRunner.prefill_packed`, which still computes a prefix shared inside the pack only once).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from aaflow.runtime.calls import Call, PackCall, PrefillCall
from aaflow.runtime.replies import PrefillReply

# Tokens a pack may add to compute beyond its first request's: calls stay short, so decode steps interleave.
PACK_MAX_TOKENS = 1024
# Fresh requests are compared with the first one starting with the same LEADER_KEY_TOKENS tokens (one
# KV block): prompts that share only a short chat header must still find each other, or each is
# costed whole and they split into several packs.
LEADER_KEY_TOKENS = 16
COMPARE_RUN = 512  # ids compared at a time when looking for where two requests differ

Queued = tuple[Call, Callable | None]  # a queued call and what to do with its value


def pack_prefills(first: Queued, queue: deque, fresh: set[str], always: bool = False) -> Queued:
    """`first` is a queued PREFILL call just taken from `queue`; take the other PREFILL calls of the
    queue too (while they add at most PACK_MAX_TOKENS tokens to compute) and return one PACK call
    whose callback answers each. `fresh` names the sessions whose request is their first: such a
    request that reuses the prefix cache computes only what an earlier fresh member does not (the
    engine computes a prefix shared inside a pack once), so many agents' prompts on one shared
    system prompt go in one call. A lone call comes back as it was, unless `always`."""
    taken, rest, total = [first], deque(), 0
    leaders: dict[tuple, list[int]] = {}  # first LEADER_KEY_TOKENS ids -> the fresh request leading them
    _tokens_to_compute(first[0], leaders, fresh)  # it may lead
    while queue:
        item = queue.popleft()
        call = item[0]
        if not isinstance(call, PrefillCall):
            rest.append(item)
            continue
        cost = _tokens_to_compute(call, leaders, fresh)
        if total + cost <= PACK_MAX_TOKENS:
            taken.append(item)
            total += cost
        else:
            rest.append(item)
            key = tuple(call.token_ids[:LEADER_KEY_TOKENS]) if leaders else None
            if key is not None and leaders.get(key) is call.token_ids:  # left out, it cannot lead
                del leaders[key]
    queue.extend(rest)
    if len(taken) == 1 and not always:
        return first
    requests = [call.requests[0] for call, _ in taken]
    thens = [then for _, then in taken]

    def answer_each(outs: list[PrefillReply]) -> None:
        for then, out in zip(thens, outs):
            then(out)

    return PackCall(requests), answer_each


def _tokens_to_compute(call: PrefillCall, leaders: dict, fresh: set[str]) -> int:
    """The call's tokens minus what it shares with the first fresh request of the pack that
    starts like it (`leaders`, updated here)."""
    ids = call.token_ids
    if not (call.reuse_prefix and call.sid in fresh):
        return len(ids)
    leader = leaders.setdefault(tuple(ids[:LEADER_KEY_TOKENS]), ids)
    if leader is ids:
        return len(ids)
    return len(ids) - common_prefix_len(ids, leader)


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of two id sequences (slices compare in C: runs of
    COMPARE_RUN ids, then bisection inside the first run that differs)."""
    n = min(len(a), len(b))
    if len(a) == len(b) and a == b:  # the common case (a cached run met again): one compare, no copies
        return n
    lo, hi = 0, min(n, COMPARE_RUN)
    while lo < n and a[lo:hi] == b[lo:hi]:
        lo, hi = hi, min(n, hi + COMPARE_RUN)
    if lo >= n:
        return n
    # now a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
