"""Idle cores lent to a long prefill.

Each built-in replica computes on its share of its node's cores (torch threads). When the
scheduler sends a long prefill to a replica while every other built-in replica on the same node has
nothing to do and nothing coming (no call in flight or queued, and every unfinished agent placed
there waits for a shared prefix still being made), the call runs on their threads too
(`ModelReplica.with_threads`). An agent about to send its own prompt rules its replica out: lending
its threads then would oversubscribe the node for the whole call (counting a momentary gap between
two calls as idle made runs slower). Prefill is compute-bound and speeds up with more threads, while
a decode step, bound by weight reads, gains nothing.
In float32 the results are bitwise those of one thread; in bfloat16 the last bits may differ, as
they do between chunkings.
"""

from __future__ import annotations

LEND_MIN_TOKENS = 256  # shorter prefills are too small to split across threads with profit


def lent_threads(replica, replicas: list, info: dict, idle: set[str]) -> int:
    """Threads that the `idle` built-in replicas on `replica`'s node can lend it (0: none, or
    `replica` is not a built-in engine or its node is unknown)."""
    node = info.get(replica.name, {}).get("node")
    if replica.engine != "builtin" or node is None:
        return 0
    return sum(info[r.name].get("threads", 1) for r in replicas
               if r is not replica and r.engine == "builtin" and r.name in idle
               and info.get(r.name, {}).get("node") == node)
