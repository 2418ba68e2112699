"""The executor's replica calls: one FIFO queue per replica, one call in flight per replica.

A replica with decoding sessions alternates batched decode steps with its queued calls; queued
prompt segments of several agents go as one packed call (`packing`), and with the decode step in
one forward pass when the replica also decodes (a mixed step).
"""

from __future__ import annotations

from collections import deque

from aaflow.runtime.core_lending import LEND_MIN_TOKENS, PREFILL_KINDS, call_tokens, lent_threads
from aaflow.runtime.packing import call_sessions, pack_chunks


class ReplicaCalls:
    """Mixin for `Executor` (uses its cluster, agents, queues, in-flight tables and `_on_step`)."""

    def _call(self, replica, kind: str, method: str, *args, then=None, **kwargs) -> None:
        self.queues[replica.name].append((kind, method, args, kwargs, then))

    def _launch(self) -> None:
        busy = {name for name, _, _ in self.inflight.values()}
        for replica in self.cluster.replicas():
            if replica.name in busy or replica.name in self.dead:
                continue
            decoding = [a for a in self.agents.values() if a.replica is replica and a.state == "decoding"]
            queue = self.queues[replica.name]
            if decoding and queue and queue[0][0] == "chunk":  # decode and prefill in one pass
                _, _, (requests,), _, answer = self._pack(queue, always=True)
                sids = [a.sid for a in decoding]
                ref = replica.actor.session_step_mixed.remote(sids, requests)
                then = lambda out, ds=decoding, a=answer: self._on_mixed(ds, a, out)  # noqa: E731
                self.inflight[ref] = (replica.name, then, "step")
                self.involved[ref] = [a.node.name for a in decoding] + [
                    a.node.name for a in self.agents.values() if a.sid in call_sessions("chunks", (requests,))]
                self.last_kind[replica.name] = "step"
            elif decoding and (not queue or self.last_kind.get(replica.name) != "step"):
                sids = [a.sid for a in decoding]
                ref = replica.actor.session_step.remote(sids)
                self.inflight[ref] = (replica.name, lambda toks, ds=decoding: self._on_step(ds, toks), "step")
                self.involved[ref] = [a.node.name for a in decoding]
                self.last_kind[replica.name] = "step"
            elif queue:
                item = self._pack(queue) if queue[0][0] == "chunk" else queue.popleft()
                kind, method, args, kwargs, then = item
                ref = self._remote_call(replica, kind, method, args, kwargs)
                self.inflight[ref] = (replica.name, then or (lambda _: None), kind)
                sids = call_sessions(kind, args)
                self.involved[ref] = [a.node.name for a in self.agents.values() if a.sid in sids]
                self.last_kind[replica.name] = kind

    def _remote_call(self, replica, kind: str, method: str, args: tuple, kwargs: dict):
        """Start a queued call on `replica`; a long prefill borrows the threads of the idle replicas
        of its node (`core_lending`)."""
        tokens = call_tokens(kind, args) if self.lend_cores and kind in PREFILL_KINDS else 0
        lent = 0
        if tokens >= LEND_MIN_TOKENS:
            lent = lent_threads(replica, self.cluster.replicas(), self.cluster.info, self._idle_replicas())
        if not lent:
            return getattr(replica.actor, method).remote(*args, **kwargs)
        own = self.cluster.info[replica.name].get("threads", 1)
        self.events.append(f"{self.now():.2f}s {replica.name} prefills {tokens} tokens on {own + lent} threads "
                           f"({lent} lent by idle replicas)")
        return replica.actor.with_threads.remote(own + lent, method, *args, **kwargs)

    def _idle_replicas(self) -> set[str]:
        """Replicas with no call in flight (those launched so far included) or queued, whose
        unfinished agents all wait for a shared prefix: nothing can reach them during a prefill."""
        busy = {name for name, _, _ in self.inflight.values()}
        waiting = {id(a) for waiters in self.prefix_waiters.values() for a in waiters}
        return {r.name for r in self.cluster.replicas()
                if r.name not in busy and r.name not in self.dead and not self.queues[r.name]
                and all(a.state == "done" or id(a) in waiting for a in self.agents.values() if a.replica is r)}

    def _on_mixed(self, decoding: list, answer_prefills, out: tuple[list[int], list[dict]]) -> None:
        self._on_step(decoding, out[0])
        answer_prefills(out[1])

    def _pack(self, queue: deque, always: bool = False) -> tuple:
        """The queue's first item (a prompt segment) with the others that pack with it; with
        `always`, as a "chunks" item even when it goes alone."""
        fresh = {a.sid for a in self.agents.values() if a.busy and a.fresh}
        return pack_chunks(queue.popleft(), queue, fresh, always)
