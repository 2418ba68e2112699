"""What the scheduler knows of its agents and replicas, in one object.

The scheduler writes it; its parts (`CallQueues`, `PrefixSharing`, `Recovery`) read it and hand
their decisions back (return values, or the callbacks the scheduler gave them). None of them holds
the scheduler or changes what is here, but for the event log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.backend import Backend, ReplicaInfo


@dataclass
class SchedulerState:
    """Agents by name, and per replica: who is placed there, who decodes there, whether it died."""

    backend: Backend
    eos: dict[str, set[int]] = field(default_factory=dict)  # model -> its end-of-sequence token ids
    agents: dict[str, AgentState] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    placed: dict[str, list[AgentState]] = field(default_factory=dict)  # replica -> agents placed there
    decoding: dict[str, list[AgentState]] = field(default_factory=dict)  # replica -> in placement order
    load: dict[str, int] = field(default_factory=dict)  # replica -> unfinished agents placed there
    readers: dict[str, list[AgentState]] = field(default_factory=dict)  # agent -> its consumers
    streaming_readers: dict[str, list[AgentState]] = field(default_factory=dict)  # those that stream its tokens
    fresh_sids: set[str] = field(default_factory=set)  # sessions whose first prompt segment is queued or running
    dropped_sids: set[str] = field(default_factory=set)  # sessions of agents whose run failed or was cancelled
    events: list[str] = field(default_factory=list)
    replicas: list[ReplicaInfo] = field(init=False)  # the backend's, asked once

    def __post_init__(self) -> None:
        self.replicas = self.backend.replicas()
        for r in self.replicas:
            self.placed.setdefault(r.name, [])
            self.decoding.setdefault(r.name, [])
            self.load.setdefault(r.name, 0)

    def now(self) -> float:
        return self.backend.now()

    def note(self, text: str) -> None:
        """Write `text` to the event log, stamped with the backend's clock."""
        self.events.append(f"{self.now():.2f}s {text}")
