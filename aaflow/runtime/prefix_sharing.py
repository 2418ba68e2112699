"""Prefix sharing for the executor: a static prefix (chat header + leading contexts) is
materialized once per workflow, forked by every agent on the same replica and transferred to
other replicas that need it; an evict node frees it early."""

from __future__ import annotations

from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from aaflow.runtime.executor import _Agent


class PrefixSharing:
    """Mixin for `Executor` (uses its prefix tables, `_call` and `_opened`)."""

    def _with_prefix(self, agent: _Agent, prefix: tuple) -> None:
        """Fork the prefix's KV on the agent's replica, materializing or transferring it first.
        `prefix` is (model, token ids); tables are keyed by it, plus a replica name where needed."""
        holders = self.prefix_refs.setdefault(prefix, {})
        rname = agent.replica.name
        if rname in holders:
            self._call(agent.replica, "open", "session_open", agent.sid, holders[rname],
                       then=lambda _: self._opened(agent, prefix_len=len(prefix[1])))
            return
        waiting = self.prefix_waiters.setdefault(prefix + (rname,), [])
        waiting.append(agent)
        if len(waiting) > 1:
            return
        source = next((r for r in self.cluster.replicas() if r.name in holders and r.name not in self.dead), None)
        if source is not None:
            self._transfer_prefix(prefix, source, agent.replica, holders[source.name])
        elif prefix not in self.prefix_origin:  # compute it once; other replicas wait to receive it
            self.prefix_origin[prefix] = agent.replica.name
            self._call(agent.replica, "prefill", "materialize", list(prefix[1]),
                       then=lambda rec: self._prefix_materialized(prefix, agent.replica, rec))

    def _transfer_prefix(self, prefix: tuple, source, dest, ref_id: str) -> None:
        transport = self.transport or "ray"
        key = prefix + (dest.name,)
        self.transferring[key] = None

        def received(res) -> None:
            self.transferring.pop(key, None)
            self._call(source, "transfer", "release", handle_of[0], transport)
            self._prefix_ready(prefix, dest, res[0].id, res[1].nbytes)

        def exposed(out) -> None:
            handle, shape, record = out
            handle_of.append(handle)
            self.transferring[key] = (source, handle, transport)
            self._call(dest, "transfer", "receive", handle, shape, record, transport, then=received)

        handle_of: list = []
        self._call(source, "transfer", "expose", ref_id, transport, then=exposed)

    def _prefix_materialized(self, prefix: tuple, replica, record) -> None:
        self.shared_prefill_computed += record.computed
        self._prefix_ready(prefix, replica, record.id, 0)

    def _prefix_ready(self, prefix: tuple, replica, ref_id: str, nbytes: int) -> None:
        self.prefix_refs.setdefault(prefix, {})[replica.name] = ref_id
        waiters = self.prefix_waiters.pop(prefix + (replica.name,), [])
        if waiters:  # one transfer serves every waiter: its bytes count once, for the first
            waiters[0].result.bytes_moved += nbytes
        for agent in waiters:
            self._with_prefix(agent, prefix)
        for key, waiters in list(self.prefix_waiters.items()):  # replicas waiting for this prefix
            if key[:-1] == prefix and waiters and key not in self.transferring:
                self._transfer_prefix(prefix, replica, waiters[0].replica, ref_id)

    def _evict_if_forked(self, prefix: tuple) -> None:
        """An evict node named a context of this prefix: free its shared KV once every agent that
        shares it has forked it (an agent restarted later materializes it again)."""
        sharers = [a for a in self.agents.values() if a.prefix_key == prefix and a.evicts_prefix]
        if any(a.state in ("new", "opening") for a in sharers):
            return
        for rname, ref_id in self.prefix_refs.pop(prefix, {}).items():
            if rname not in self.dead:
                self._call(next(r for r in self.cluster.replicas() if r.name == rname), "close", "free", ref_id)
        self.prefix_origin.pop(prefix, None)
        self.events.append(f"{self.now():.2f}s evicted a shared prefix of {len(prefix[1])} tokens")
