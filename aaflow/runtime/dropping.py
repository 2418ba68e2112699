"""Ending one run inside a scheduler that serves many: drop its agents, free what only it read.

A run that failed, was cancelled or passed its deadline leaves the shared scheduler alone: each of
its unfinished agents is marked done (`dropped`), gives its KV reservation back, leaves the decode
batch, the admission queue and the prefix waiters, loses its queued prompt segments, and has its
session closed after whatever call of it is in flight (a replica runs its calls in order). Calls
of it that end later find it dropped and do nothing. The other runs' agents are not touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aaflow.runtime.calls import CloseCall, PrefillCall

if TYPE_CHECKING:
    from aaflow.runtime.agent_state import AgentState
    from aaflow.runtime.scheduler import Scheduler


def drop(scheduler: Scheduler, agents: list[AgentState]) -> None:
    """End `agents` (one run's) without their output; their sessions are closed."""
    s = scheduler
    for agent in agents:
        if agent.state == "done":
            continue
        replica = agent.replica
        if replica is not None:
            if agent in s.decoding[replica]:
                s.decoding[replica].remove(agent)
            s.load[replica] -= 1
            queue = s.queues.queues.get(replica)
            if queue:
                kept = [q for q in queue if not (isinstance(q[0], PrefillCall) and q[0].sid == agent.sid)]
                queue.clear()
                queue.extend(kept)
            if agent.state not in ("new", "admitting") and replica not in s.dead:
                s.queues.call(replica, CloseCall(agent.sid))
        s.release_kv(agent)
        s.admission.gated.pop(agent.name, None)
        for key, waiting in list(s.prefixes.waiters.items()):
            if agent in waiting:
                waiting.remove(agent)
                if not waiting:
                    del s.prefixes.waiters[key]
        s.fresh_sids.discard(agent.sid)
        s.dropped_sids.add(agent.sid)
        agent.state, agent.dropped, agent.busy = "done", True, False
        agent.end_s = s.now()
        s.unfinished -= 1


def free_unread_prefixes(scheduler: Scheduler, agents: list[AgentState], kept=()) -> int:
    """A run ended: free the shared prefixes its agents forked that no unfinished agent of any run
    will read (a prefix that another run's pending agents read stays: it is computed once), but
    those in `kept`. Answers how many it freed."""
    keys = {a.prefix_key for a in agents if a.prefix_key not in kept}
    return free_unread(scheduler, keys)


def free_unread(scheduler: Scheduler, keys: set) -> int:
    """Free the shared prefixes of `keys` that are held, that no unfinished agent of any run will
    read and that nothing is on its way for. Answers how many it freed."""
    s = scheduler
    keys = {k for k in keys if k in s.prefixes.refs}
    if not keys:
        return 0
    pending = {a.prefix_key for a in s.agents.values() if a.state != "done" and a.prefix_key in keys}
    freed = 0
    for key in keys - pending:
        if any(k[:-1] == key for k in s.prefixes.waiters) or any(k[:-1] == key for k in s.prefixes.transferring):
            continue  # something is still on its way for it
        s.prefixes.forget(key)
        freed += 1
    return freed
