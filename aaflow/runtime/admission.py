"""Admission: an agent opens on a replica only when the KV it can reach fits that replica's pool.

An agent reserves, when admitted, the blocks its whole prompt and output can take (its static
tokens, its upstream agents' `max_tokens`, its own `max_tokens`), and gives them back when it ends
or starts over. An agent that does not fit waits in its replica's queue, in the order agents were
placed (upstream agents are placed before the agents reading them, so a waiting producer is never
overtaken by its consumers); each release admits from the head of the queue. An agent that would
not fit even alone is admitted when its replica holds no other reservation (its output may stop
early); a real shortage is then handled by preemption (`Recovery.failure`).

Agents on one replica whose prompts start with the same static prefix (chat header and leading
contexts) hold its full blocks once, through the prefix cache or a fork: those blocks are reserved
once per replica while any of them is admitted, not once per agent (counted per agent, a pool
with room for one 2,000-token prefix and eight agents' own blocks admitted one of the eight;
`tests/core/test_admission_shared_prefix.py`). Agents that turn KV reuse off (`text-nocache`)
and replicas without a prefix cache count every agent's prefix. The rest is conservative (an
upstream agent's output and the block a fork copies count in full for each).

The queue knows the workflow graph: an agent whose prefix is resident on its replica (an admitted
agent holds it, or a shared prefix lives there) is admitted before older agents that would bring a
new one, so that the readers of a document run while its KV is there rather than after work that
evicts it (it costs only its own blocks). The last holder of a prefix hands it over: its waiting
readers (opened as it ends, before its release: a workflow's next agent on the same document) are
admitted while its prefix still counts as held, and only then is the prefix's room given back.
Oldest first otherwise, and the oldest waiting agent is overtaken at most `MAX_PASSES` times, so
nothing starves. Reservations cover every run of the cluster's one scheduling loop; pinned
contexts and other clients of the replicas (another deployment) are found out by the replica's
`KVCapacityError`, which preempts. Replicas that do not say how many blocks they have (vLLM, the
simulated clock) admit everyone: vLLM's own scheduler queues and preempts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from aaflow.runtime.agent_state import AgentPhase
from aaflow.runtime.prompts import AgentInput, static_prefix
from aaflow.common.strategies import TEXT_NOCACHE

if TYPE_CHECKING:
    from aaflow.runtime.agent_state import AgentState
    from aaflow.runtime.backend import ReplicaInfo

MAX_PASSES = 32  # times the oldest waiting agent may be overtaken by readers of a resident prefix


class Admission:
    """Per-replica KV reservations and the agents waiting for room. It decides; the scheduler
    opens: `admit` says whether an agent may open now, `release` returns the waiting agents it
    admitted, `head` the one to force when nothing runs."""

    def __init__(self, replicas: list[ReplicaInfo], agents: dict[str, AgentState], dead: set[str],
                 shared_resident: Callable[[tuple, str], bool]) -> None:
        """`agents` (every agent by name, to read upstream lengths), `dead` (lost replicas) and
        `shared_resident(prefix key, replica)` (a shared prefix lives there) are the scheduler's,
        read here, never changed."""
        self.agents, self.dead, self.shared_resident = agents, dead, shared_resident
        self.capacity = {r.name: r.kv_blocks for r in replicas}  # None: not limited here
        self.block_tokens = {r.name: max(1, r.block_tokens) for r in replicas}
        self.reserved = {r.name: 0 for r in replicas}
        self.holds: dict[str, tuple[str, int, tuple | None]] = {}  # agent -> (replica, blocks, prefix key)
        self.waiting: dict[str, list[AgentState]] = {r.name: [] for r in replicas}
        self.gated: dict[str, str] = {}  # preempted agent -> the replica where it waits for a release
        self.prefix_cache = {r.name: r.prefix_cache for r in replicas}
        self.prefix_holders: dict[tuple, int] = {}  # (replica, prefix key) -> agents admitted holding it
        self.passes: dict[str, int] = {}  # waiting agent -> times a reader of a resident prefix overtook it

    def blocks(self, agent: AgentState, replica: str) -> int:
        """The most blocks `agent` can hold on `replica`: prompt at its longest plus its output."""
        agents = self.agents
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
        if self._may_admit(agent, replica) and (not queue or self._overtakes(agent, queue)):
            self._reserve(agent)
            return True
        if agent not in queue:
            queue.append(agent)
            agent.state = AgentPhase.ADMITTING
        return False

    def release(self, agent: AgentState) -> list[AgentState]:
        """`agent` ended or starts over: give its blocks back; the waiting agents that now fit there,
        admitted (their room reserved), in the order they are to open."""
        hold = self.holds.pop(agent.name, None)
        self.passes.pop(agent.name, None)
        for queue in self.waiting.values():
            if agent in queue:
                queue.remove(agent)
        if hold is None:
            return []
        replica, blocks, key = hold
        self.reserved[replica] -= blocks
        self.ungate(replica)
        admitted = self._admit_readers(replica)  # its prefix still held: its waiting readers take it over
        if key is not None:
            self._drop_holder(replica, key)
        return admitted + self._admit_waiting(replica)

    def gate(self, agent: AgentState) -> None:
        """`agent` was preempted on its replica: it is admitted there again only after a release."""
        self.gated[agent.name] = agent.replica

    def ungate(self, replica: str) -> None:
        """Something was released on `replica` (or it came back empty): its preempted agents may be
        admitted there again."""
        for name in [n for n, r in self.gated.items() if r == replica]:
            del self.gated[name]

    def drop(self, agent: AgentState) -> None:
        """`agent`'s run ended: it waits for no release."""
        self.gated.pop(agent.name, None)

    def head(self) -> AgentState | None:
        """The agent at the head of the first live replica's queue, or None when nobody waits: what
        the scheduler forces when nothing runs (preemption handles a real shortage)."""
        return next((queue[0] for replica, queue in self.waiting.items() if queue and replica not in self.dead), None)

    def is_waiting(self, agent: AgentState) -> bool:
        return any(agent in queue for queue in self.waiting.values())

    def force(self, agent: AgentState) -> None:
        """Admit a waiting agent whether it fits or not."""
        self.gated.pop(agent.name, None)
        self.waiting[agent.replica].remove(agent)
        self._reserve(agent)

    def resident(self, agent: AgentState) -> bool:
        """Its static prefix (a block or more) is on its replica: held by an admitted agent there,
        or a shared prefix there."""
        replica, key = agent.replica, agent.prefix_key
        return self.shared_blocks(agent, replica) > 0 and (
            (replica, key) in self.prefix_holders or self.shared_resident(key, replica))

    def _overtakes(self, agent: AgentState, queue: list[AgentState]) -> bool:
        """`agent` may go before the waiting `queue`: it reads a resident prefix and the oldest
        waiting agent has not been overtaken `MAX_PASSES` times (counted here when it may)."""
        head = queue[0].name
        if not self.resident(agent) or self.passes.get(head, 0) >= MAX_PASSES:
            return False
        self.passes[head] = self.passes.get(head, 0) + 1
        return True

    def _admit_readers(self, replica: str) -> list[AgentState]:
        """The waiting readers of resident prefixes that fit, oldest first (the head of the queue
        too, which overtakes nobody). The agents admitted."""
        queue, admitted = self.waiting[replica], []
        if replica in self.dead:
            return admitted
        for agent in [a for a in queue if self.resident(a)]:
            if self._may_admit(agent, replica) and (agent is queue[0] or self._overtakes(agent, queue)):
                queue.remove(agent)
                admitted.append(agent)
                self._reserve(agent)
        return admitted

    def _admit_waiting(self, replica: str) -> list[AgentState]:
        """Readers of resident prefixes that fit first, oldest first; then the queue in order
        while its head fits. The agents admitted."""
        queue, admitted = self.waiting[replica], self._admit_readers(replica)
        if replica in self.dead:
            return admitted
        while queue and self._may_admit(queue[0], replica):
            admitted.append(queue.pop(0))
            self._reserve(admitted[-1])
        return admitted

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
