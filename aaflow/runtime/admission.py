"""Admission: an agent opens on a replica only when the KV it can reach fits that replica's pool.

An agent reserves, when admitted, the blocks its whole prompt and output can take (its static
tokens, its upstream agents' `max_tokens`, its own `max_tokens`), and gives them back when it ends
or starts over. An agent that does not fit waits in its replica's queue, in the order agents were
placed (upstream agents are placed before the agents reading them, so a waiting producer is never
overtaken by its consumers); each release admits from the head of the queue. An agent that would
not fit even alone is admitted when its replica holds no other reservation (its output may stop
early); a real shortage is then handled by preemption (`Recovery.kv_short`).

Agents on one replica whose prompts start with the same static prefix (chat header and leading
contexts) hold its full blocks once, through the prefix cache or a fork: those blocks are reserved
once per replica while any of them is admitted, not once per agent (counted per agent, a pool
with room for one 2,000-token prefix and eight agents' own blocks admitted one of the eight;
`tests/test_admission_shared_prefix.py`). Agents that turn KV reuse off (`text-nocache`)
and replicas without a prefix cache count every agent's prefix. The rest is conservative (an
upstream agent's output and the block a fork copies count in full for each). Reservations cover
this run only: other runs on the same replicas and pinned contexts are found out by the replica's
`KVCapacityError`, which preempts. Replicas that do not say how many blocks they have (vLLM, the
simulated clock) admit everyone: vLLM's own scheduler queues and preempts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aaflow.runtime.prompts import AgentInput, static_prefix
from aaflow.strategies import TEXT_NOCACHE

if TYPE_CHECKING:
    from aaflow.runtime.agent_state import AgentState
    from aaflow.runtime.scheduler import Scheduler


class Admission:
    """Per-replica KV reservations and the agents waiting for room."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.capacity = {r.name: r.kv_blocks for r in scheduler.replicas}  # None: not limited here
        self.block_tokens = {r.name: max(1, r.block_tokens) for r in scheduler.replicas}
        self.reserved = {r.name: 0 for r in scheduler.replicas}
        self.holds: dict[str, tuple[str, int, tuple | None]] = {}  # agent -> (replica, blocks, prefix key)
        self.waiting: dict[str, list[AgentState]] = {r.name: [] for r in scheduler.replicas}
        self.gated: dict[str, str] = {}  # preempted agent -> the replica where it waits for a release
        self.prefix_cache = {r.name: r.prefix_cache for r in scheduler.replicas}
        self.prefix_holders: dict[tuple, int] = {}  # (replica, prefix key) -> agents admitted holding it

    def blocks(self, agent: AgentState, replica: str) -> int:
        """The most blocks `agent` can hold on `replica`: prompt at its longest plus its output."""
        agents = self.scheduler.agents
        tokens = agent.max_tokens + sum(agents[s.agent].max_tokens if isinstance(s, AgentInput) else len(s)
                                        for s in agent.segments)
        return -(-tokens // self.block_tokens[replica]) + 1  # + the block a fork copies on write

    def shared_blocks(self, agent: AgentState, replica: str) -> int:
        """The full blocks of `agent`'s static prefix that other agents with that prefix on `replica`
        share with it (0 where every agent holds its own copy)."""
        if agent.strategy == TEXT_NOCACHE or not (self.prefix_cache.get(replica, True) or agent.shares_prefix):
            return 0
        return len(static_prefix(agent.segments)) // self.block_tokens[replica]

    def cost(self, agent: AgentState, replica: str) -> int:
        """Blocks admitting `agent` on `replica` adds to the reservations: its own, plus its shared
        prefix's unless an admitted agent already holds that prefix there."""
        shared = self.shared_blocks(agent, replica)
        held = (replica, agent.prefix_key) in self.prefix_holders
        return self.blocks(agent, replica) - (shared if held else 0)

    def fits(self, agent: AgentState, replica: str) -> bool:
        capacity = self.capacity.get(replica)
        return capacity is None or self.reserved[replica] + self.cost(agent, replica) <= capacity

    def admit(self, agent: AgentState) -> bool:
        """Reserve room for `agent` on its replica now, or queue it (False)."""
        replica = agent.replica
        queue = self.waiting[replica]
        if not queue and self._may_admit(agent, replica):
            self._reserve(agent)
            return True
        if agent not in queue:
            queue.append(agent)
            agent.state = "admitting"
        return False

    def release(self, agent: AgentState) -> None:
        """`agent` ended or starts over: give its blocks back and admit whoever now fits there."""
        hold = self.holds.pop(agent.name, None)
        for queue in self.waiting.values():
            if agent in queue:
                queue.remove(agent)
        if hold is None:
            return
        replica, blocks, key = hold
        self.reserved[replica] -= blocks
        if key is not None:
            self._drop_holder(replica, key)
        for name in [n for n, r in self.gated.items() if r == replica]:
            del self.gated[name]
        self._admit_waiting(replica)

    def gate(self, agent: AgentState) -> None:
        """`agent` was preempted on its replica: it is admitted there again only after a release."""
        self.gated[agent.name] = agent.replica

    def force_one(self) -> bool:
        """Nothing runs and agents wait for room: admit the first waiting agent anyway (preemption
        handles a real shortage). False when nobody waits."""
        for replica, queue in self.waiting.items():
            if queue and replica not in self.scheduler.dead:
                first = queue[0]
                if first.name in self.gated:  # preempted while nothing of this run runs: other runs hold
                    recovery = self.scheduler.recovery  # the KV; free ours there too, then wait a while
                    recovery.yield_kv(replica, keep=first)
                    self.scheduler.backend.pause(recovery.backoff_s(first))
                    if first not in queue:  # admitted meanwhile
                        return True
                    self.gated.pop(first.name, None)
                queue.remove(first)
                self._open(first)
                return True
        return False

    def _admit_waiting(self, replica: str) -> None:
        queue = self.waiting[replica]
        if replica in self.scheduler.dead:
            return
        while queue and self._may_admit(queue[0], replica):
            self._open(queue.pop(0))

    def _may_admit(self, agent: AgentState, replica: str) -> bool:
        """Not waiting for a release there after a preemption, and it fits (or the replica holds
        no other reservation)."""
        return self.gated.get(agent.name) != replica and (self.fits(agent, replica) or not self.reserved[replica])

    def _reserve(self, agent: AgentState) -> None:
        """Hold `agent`'s own blocks, and its shared prefix's blocks for all its holders (the first
        holder adds them, as `cost` counts; the last one to leave gives them back)."""
        replica = agent.replica
        shared = self.shared_blocks(agent, replica)
        self.reserved[replica] += self.cost(agent, replica)
        key = (agent.prefix_key, shared) if shared else None
        if key is not None:
            self.prefix_holders[(replica, key[0])] = self.prefix_holders.get((replica, key[0]), 0) + 1
        self.holds[agent.name] = (replica, self.blocks(agent, replica) - shared, key)

    def _drop_holder(self, replica: str, key: tuple) -> None:
        prefix, shared = key
        left = self.prefix_holders.pop((replica, prefix)) - 1
        if left:
            self.prefix_holders[(replica, prefix)] = left
        else:
            self.reserved[replica] -= shared

    def _open(self, agent: AgentState) -> None:
        self._reserve(agent)
        self.scheduler.opened_admitted(agent)
