"""The abstract workflow the planner sees: agents as token counts, not text.

The runtime builds a `WorkflowSpec` from a real `Workflow` (prompt segments tokenized by the
model's prompt builder); the simulator and the planner only need lengths and the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Union

from aaflow.common.errors import CostModelError
from aaflow.common.strategies import DEFAULT_BLOCK_TOKENS

SegmentSpec = Union[int, str]  # a known token count, or an upstream agent's name (its output tokens)


@dataclass(frozen=True)
class AgentTask:
    """One agent of a workflow, reduced to what costs time.

    The prompt is `prefix_tokens` of shareable static prefix, then `segments` in order.
    """

    name: str
    """Unique within the workflow."""
    model: str
    """Model name: the key into `models` and `ClusterSpec.replicas`."""
    prefix_key: str
    """Identity of the shareable static prefix (chat header + leading contexts): equal keys mean
    identical tokens, so the prefix cache or a shared KV prefix can serve them."""
    prefix_tokens: int
    """Length of that prefix in tokens."""
    segments: tuple[SegmentSpec, ...] = ()
    """After the prefix, in order: an int is a known token count, a str an upstream agent's name."""
    output_tokens: int = 1
    """Tokens it generates (no early end-of-sequence is assumed)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise CostModelError("an agent needs a non-empty name")
        if self.prefix_tokens < 0:
            raise CostModelError(f"agent {self.name!r}: prefix_tokens must be >= 0, got {self.prefix_tokens}")
        if self.output_tokens < 1:
            raise CostModelError(f"agent {self.name!r}: output_tokens must be >= 1, got {self.output_tokens}")
        for seg in self.segments:
            if isinstance(seg, bool) or not isinstance(seg, (int, str)) or (isinstance(seg, int) and seg < 0):
                raise CostModelError(f"agent {self.name!r}: a segment must be a token count >= 0 or an agent "
                                     f"name, got {seg!r}")

    @cached_property
    def upstream(self) -> tuple[str, ...]:
        """Names of the agents whose output this agent reads, in prompt order, without repeats."""
        return tuple(dict.fromkeys(s for s in self.segments if isinstance(s, str)))


@dataclass(frozen=True)
class WorkflowSpec:
    """A workflow DAG of `AgentTask`s in declaration order (the order the scheduler opens them)."""

    name: str
    agents: tuple[AgentTask, ...]

    def __post_init__(self) -> None:
        names = [a.name for a in self.agents]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise CostModelError(f"workflow {self.name!r}: agent {name!r} is declared twice")
            seen.add(name)
        for agent in self.agents:
            for up in agent.upstream:
                if up not in seen:
                    raise CostModelError(f"agent {agent.name!r} reads unknown upstream agent {up!r}; "
                                         f"known agents: {names}")
                if up == agent.name:
                    raise CostModelError(f"agent {agent.name!r} reads its own output")
        self._check_acyclic()

    def _check_acyclic(self) -> None:
        state: dict[str, int] = {}  # 1: on the current path, 2: finished

        def visit(name: str) -> None:
            state[name] = 1
            for up in self.agent(name).upstream:
                if state.get(up) == 1:
                    raise CostModelError(f"agent {name!r} is on a cycle through {up!r}")
                if up not in state:
                    visit(up)
            state[name] = 2

        for agent in self.agents:
            if agent.name not in state:
                visit(agent.name)

    @cached_property
    def _by_name(self) -> dict[str, AgentTask]:
        return {a.name: a for a in self.agents}

    @cached_property
    def _consumers(self) -> dict[str, tuple[str, ...]]:
        readers: dict[str, list[str]] = {a.name: [] for a in self.agents}
        for agent in self.agents:
            for up in agent.upstream:
                readers[up].append(agent.name)
        return {name: tuple(names) for name, names in readers.items()}

    def agent(self, name: str) -> AgentTask:
        """The agent called `name` (CostModelError if there is none)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise CostModelError(f"workflow {self.name!r} has no agent {name!r}") from None

    def upstream(self, name: str) -> list[str]:
        """Agents whose output `name` reads."""
        return list(self.agent(name).upstream)

    def consumers(self, name: str) -> list[str]:
        """Agents that read the output of `name`, in declaration order."""
        self.agent(name)
        return list(self._consumers[name])

    def models(self) -> list[str]:
        """The models the agents use, in first-use order."""
        return list(dict.fromkeys(a.model for a in self.agents))


@dataclass(frozen=True)
class ClusterSpec:
    """Replicas as the planner sees them."""

    replicas: tuple[tuple[str, str], ...]
    """(replica name, model name) in cluster order (the scheduler's iteration and tie-break order)."""
    link: str = "ray"
    """Transport between replicas: a `HardwareProfile` link name or a bandwidth such as "10Gbps"."""
    chunk_tokens: int = 16
    """Minimum tokens per streamed chunk of incremental prefill (the scheduler's `chunk_tokens`)."""
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Tokens per KV block of the replicas' pools: their prefix caches serve whole blocks."""

    def __post_init__(self) -> None:
        if not self.replicas:
            raise CostModelError("a cluster needs at least one replica")
        names = [name for name, _ in self.replicas]
        if len(set(names)) != len(names):
            raise CostModelError(f"replica names must be unique, got {names}")
        if self.chunk_tokens < 1:
            raise CostModelError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.block_tokens < 1:
            raise CostModelError(f"block_tokens must be >= 1, got {self.block_tokens}")

    def replicas_of(self, model: str) -> list[str]:
        """Replica names serving `model`, in cluster order."""
        return [name for name, m in self.replicas if m == model]

    def check_serves(self, spec: WorkflowSpec) -> None:
        """CostModelError naming the first agent whose model no replica serves."""
        for agent in spec.agents:
            if not self.replicas_of(agent.model):
                served = sorted({m for _, m in self.replicas})
                raise CostModelError(f"agent {agent.name!r} uses model {agent.model!r}, which no replica serves "
                                     f"(replicas serve {served}); add a replica or change the agent's model")
