"""Packing the queued prompt segments of several agents on one replica into one call.

A replica runs one call at a time. When several agents on it wait to prefill (prompts of agents
that start together, streamed chunks of upstream output), each segment alone would read the
model's weights once for a handful of tokens; packed, one forward pass reads them once for all
(`KVRunner.prefill_packed`, which still computes a prefix shared inside the pack only once).
"""

from __future__ import annotations

from collections import deque

PACK_MAX_TOKENS = 1024  # a packed call stays short, so that decode steps keep interleaving


def pack_chunks(first: tuple, queue: deque) -> tuple:
    """`first` is a queued ("chunk", "session_prefill", args, {}, then) item just taken from
    `queue`; take the other chunk items of the queue too (up to PACK_MAX_TOKENS tokens) and return
    one ("chunks", "session_prefill_many", (requests,), {}, then) item whose callback answers each."""
    taken, total, rest = [first], len(first[2][1]), deque()
    while queue:
        item = queue.popleft()
        if item[0] == "chunk" and total + len(item[2][1]) <= PACK_MAX_TOKENS:
            taken.append(item)
            total += len(item[2][1])
        else:
            rest.append(item)
    queue.extend(rest)
    if len(taken) == 1:
        return first
    requests = [list(item[2]) for item in taken]  # [sid, token_ids, sampling, reuse_prefix]
    thens = [item[4] for item in taken]

    def answer_each(outs: list[dict]) -> None:
        for then, out in zip(thens, outs):
            then(out)

    return "chunks", "session_prefill_many", (requests,), {}, answer_each


def call_sessions(kind: str, args: tuple) -> set:
    """The session ids a queued call works on."""
    if kind == "chunks":
        return {request[0] for request in args[0]}
    return {args[0]} if args and isinstance(args[0], str) else set()
