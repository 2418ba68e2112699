"""Packing the queued prompt segments of several agents on one replica into one call.

A replica runs one call at a time. When several agents on it wait to prefill (prompts of agents
that start together, streamed chunks of upstream output), each segment alone would read the
model's weights once for a handful of tokens; packed, one forward pass reads them once for all
(`KVRunner.prefill_packed`, which still computes a prefix shared inside the pack only once).
"""

from __future__ import annotations

from collections import deque

# Tokens a pack may add to compute beyond its first request's: calls stay short, so decode steps interleave.
PACK_MAX_TOKENS = 1024


def pack_chunks(first: tuple, queue: deque, fresh: set[str], always: bool = False) -> tuple:
    """`first` is a queued ("chunk", "session_prefill", args, {}, then) item just taken from
    `queue`; take the other chunk items of the queue too (while they add at most PACK_MAX_TOKENS
    tokens to compute) and return one ("chunks", "session_prefill_many", (requests,), {}, then)
    item whose callback answers each. `fresh` names the sessions whose request is their first:
    such a request that reuses the prefix cache computes only what an earlier fresh member does
    not (the engine computes a prefix shared inside a pack once), so many agents' prompts on one
    shared system prompt go in one call. A lone item comes back as it was, unless `always`."""
    taken, rest, leaders, total = [first], deque(), {}, 0
    _tokens_to_compute(first, leaders, fresh)  # it may lead
    while queue:
        item = queue.popleft()
        cost = _tokens_to_compute(item, leaders, fresh) if item[0] == "chunk" else None
        if cost is not None and total + cost <= PACK_MAX_TOKENS:
            taken.append(item)
            total += cost
        else:
            rest.append(item)
            if cost is not None:
                _forget(item, leaders)
    queue.extend(rest)
    if len(taken) == 1 and not always:
        return first
    requests = [list(item[2]) for item in taken]  # [sid, token_ids, sampling, reuse_prefix]
    thens = [item[4] for item in taken]

    def answer_each(outs: list[dict]) -> None:
        for then, out in zip(thens, outs):
            then(out)

    return "chunks", "session_prefill_many", (requests,), {}, answer_each


LEADER_KEY_TOKENS = 64  # fresh requests are compared with the first one starting with the same tokens


def _tokens_to_compute(item: tuple, leaders: dict, fresh: set[str]) -> int:
    """The request's tokens minus what it shares with the first fresh request of the pack that
    starts like it (`leaders`, updated here)."""
    sid, ids, _, reuse = item[2]
    if not (reuse and sid in fresh):
        return len(ids)
    leader = leaders.setdefault(tuple(ids[:LEADER_KEY_TOKENS]), ids)
    if leader is ids:
        return len(ids)
    shared = 0
    for x, y in zip(ids, leader):
        if x != y:
            break
        shared += 1
    return len(ids) - shared


def _forget(item: tuple, leaders: dict) -> None:
    """A request left out of the pack cannot lead it."""
    key = tuple(item[2][1][:LEADER_KEY_TOKENS])
    if leaders.get(key) is item[2][1]:
        del leaders[key]


def call_sessions(kind: str, args: tuple) -> set:
    """The session ids a queued call works on."""
    if kind == "chunks":
        return {request[0] for request in args[0]}
    return {args[0]} if args and isinstance(args[0], str) else set()
