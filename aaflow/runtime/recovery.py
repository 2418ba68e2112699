"""Fault handling for the executor: dead replicas, failed transfers, failed agents.

A replica that dies loses its sessions; every agent it ran starts over from its prompt tokens
(its lineage) on a live replica, and consumers that had streamed tokens from it start over too.
A failed transfer degrades to recomputing the prefix where it was going. An agent that fails
stops the run with an error naming it and the consumers that will not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aaflow.errors import AAFlowError

if TYPE_CHECKING:
    from aaflow.runtime.executor import _Agent


class AgentFailedError(AAFlowError, RuntimeError):
    """An agent failed; its consumers were stopped."""


class Recovery:
    """Mixin for `Executor` (uses its agents, queues, prefix tables and `_open` / `_call`)."""

    def _cleanup(self, ray) -> None:
        """After a failure: close every session still open on a live replica (bounded wait)."""
        calls = [a.replica.actor.session_close.remote(a.sid) for a in self.agents.values()
                 if a.replica is not None and a.replica.name not in self.dead and a.state != "done"]
        ray.wait(calls, num_returns=len(calls), timeout=10)

    def _agents_on(self, rname: str) -> list[_Agent]:
        return [a for a in self.agents.values() if a.replica is not None and a.replica.name == rname]

    def _restart(self, agent: _Agent) -> None:
        """Start an agent over from its prompt (its lineage) on a live replica."""
        agent.result.restarts += 1
        agent.state, agent.fed, agent.seg, agent.offset, agent.busy = "new", 0, 0, 0, False
        agent.output, agent.result.decoded, agent.result.first_token_s = [], 0, None
        for counter in ("prefill_computed", "prefill_reused", "streamed_tokens", "prompt_tokens"):
            setattr(agent.result, counter, 0)
        self._open_if_ready(agent)

    def _replica_died(self, rname: str) -> None:
        self.events.append(f"{self.now():.2f}s replica {rname} died; recomputing its agents elsewhere")
        self.dead.add(rname)
        self.queues[rname].clear()
        self.inflight = {r: v for r, v in self.inflight.items() if v[0] != rname}
        for holders in self.prefix_refs.values():
            holders.pop(rname, None)
        self.prefix_waiters = {k: v for k, v in self.prefix_waiters.items() if k[-1] != rname}
        self.transferring = {k: v for k, v in self.transferring.items() if k[-1] != rname}
        orphaned = {p for p, origin in self.prefix_origin.items() if origin == rname}
        for prefix in orphaned:  # whoever waited for the dead replica's prefix computes it now
            del self.prefix_origin[prefix]
            for key in [k for k in self.prefix_waiters if k[:-1] == prefix]:
                for agent in self.prefix_waiters.pop(key):
                    self._with_prefix(agent, prefix)
        lost = [a for a in self._agents_on(rname) if a.state != "done"]
        for agent in lost:
            self._restart(agent)
            for name in agent.consumers:  # they streamed tokens that will be produced again
                consumer = self.agents[name]
                if consumer.state not in ("new", "done") and consumer not in lost and consumer.fed:
                    self._call(consumer.replica, "close", "session_close", consumer.sid)
                    self._restart(consumer)

    def _call_failed(self, rname: str, kind: str, exc: BaseException, involved: list[str]) -> None:
        if kind == "transfer":  # fall back to recomputing the prefix where it was going
            self.events.append(f"{self.now():.2f}s transfer via {rname} failed ({exc}); recomputing instead")
            for key, pending in list(self.transferring.items()):
                del self.transferring[key]
                if pending is not None:
                    source, handle, transport = pending
                    self._call(source, "transfer", "release", handle, transport)
                prefix, dest = key[:-1], next(r for r in self.cluster.replicas() if r.name == key[-1])
                self._call(dest, "prefill", "materialize", list(prefix[1]),
                           then=lambda rec, p=prefix, r=dest: self._prefix_materialized(p, r, rec))
            return
        failed = involved or [a.node.name for a in self._agents_on(rname) if a.state != "done"]
        waiting = sorted({c for name in failed for c in self.agents[name].consumers})
        raise AgentFailedError(
            f"agent(s) {failed} on replica {rname} failed: {type(exc).__name__}: {exc}; "
            f"their consumers {waiting} were stopped"
        ) from exc

