"""One agent's progress through a run, as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from aaflow.runtime.kvops import KVDirective
from aaflow.runtime.run_options import RunOptions
from aaflow.runtime.prompts import AgentInput, Segment, static_prefix
from aaflow.runtime.prefix_key import PrefixIds, PrefixKey
from aaflow.runtime.results import AgentResult
from aaflow.common.strategies import STREAMS, shares_prefix


class AgentPhase(enum.StrEnum):
    """Where an agent is in its run: NEW (waiting for its inputs or for KV) -> ADMITTING (its KV is
    being reserved, its prefix may still be on its way) -> OPENING (its session is being opened on
    its replica) -> OPEN (its prompt is being fed) -> DECODING -> DONE (finished, or dropped with its
    run). A restart (its replica died, or it was preempted) sends it back to NEW."""

    NEW = "new"
    ADMITTING = "admitting"
    OPENING = "opening"
    OPEN = "open"
    DECODING = "decoding"
    DONE = "done"


@dataclass(eq=False)
class AgentState:
    """An agent: what it reads and generates, where it runs and how far it got.

    `segments` is its prompt: token-id tuples known before the run and `AgentInput`s (an upstream
    agent's output); the first is the shareable static prefix."""

    name: str
    model: str
    strategy: str
    segments: list[Segment]
    consumers: list[str]
    max_tokens: int
    sampling: object = None  # the SamplingParams its first token is sampled with
    ignore_eos: bool = False
    unordered: bool = False  # reads its inputs in completion order
    kv: KVDirective = KVDirective()
    evicts_prefix: bool = False  # its prefix holds a context an evict node names
    prefix_parts: tuple[int, ...] = ()  # with an approximate compose: the lengths of the contexts composed
    planned: bool = False  # its strategy is the planner's: a prefix it shares may be computed rather than moved
    options: RunOptions | None = None  # its run's options on a shared loop (None: the scheduler's own)
    result: AgentResult = None
    replica: str | None = None
    sid: str = ""
    state: AgentPhase = AgentPhase.NEW
    fed: int = 0  # prompt tokens sent to the replica
    seg: int = 0  # next segment to feed, and the offset inside it
    offset: int = 0
    output: list[int] = field(default_factory=list)  # generated ids without end-of-sequence
    busy: bool = False  # a prefill of this agent is queued or running
    fresh: bool = False  # ... and it is the first of its session (nothing before it in the KV)
    order: int = 0  # placements before its own (a replica decodes its agents in this order)
    start_s: float = 0.0  # when it was placed
    end_s: float = 0.0  # its last token
    prefix_via: str = ""  # how its prefix arrived: "reuse", "transfer" or "recompute"
    dropped: bool = False  # its run failed or was cancelled: DONE without its output
    upstream: tuple[str, ...] = field(init=False)  # the agents it reads, in prompt order
    streams: bool = field(init=False)  # prefills upstream tokens while the upstream still decodes
    _prefix_key: PrefixKey | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.result is None:
            self.result = AgentResult(self.name)
        self.upstream = tuple(dict.fromkeys(s.agent for s in self.segments if isinstance(s, AgentInput)))
        self.streams = self.strategy in STREAMS

    @property
    def prefix_key(self) -> PrefixKey:
        """The shared prefix it reads: its model, static prefix ids and how it is composed. Made once:
        the static prefix, `kv` and `prefix_parts` do not change during a run."""
        if self._prefix_key is None:
            compose = (*self.kv.compose, self.prefix_parts) if self.kv.compose else None
            prefix = static_prefix(self.segments)
            if isinstance(prefix, tuple) and not isinstance(prefix, PrefixIds):
                prefix = PrefixIds(prefix)
            self._prefix_key = PrefixKey(self.model, prefix, compose)
        return self._prefix_key

    @property
    def shares_prefix(self) -> bool:
        """Materializes, forks or transfers its static prefix as a KV object."""
        return self.kv.share_prefix or shares_prefix(self.strategy, len(static_prefix(self.segments)))

    def restart(self) -> None:
        """Forget its progress: it starts over from its prompt tokens (its lineage)."""
        self.result.restarts += 1
        self.state, self.fed, self.seg, self.offset, self.busy = AgentPhase.NEW, 0, 0, 0, False
        self.output, self.result.decoded, self.result.first_token_s = [], 0, None
        for counter in ("prefill_computed", "prefill_reused", "streamed_tokens", "prompt_tokens"):
            setattr(self.result, counter, 0)


def namespaced(agents: dict[str, AgentState], prefix: str) -> dict[str, AgentState]:
    """The agents renamed `prefix + name` (their inputs and readers too), so that the agents of many
    runs live apart in one scheduler; their results keep the workflow's names."""
    renamed = {}
    for a in agents.values():
        segments = [AgentInput(prefix + s.agent) if isinstance(s, AgentInput) else s for s in a.segments]
        renamed[prefix + a.name] = replace(a, name=prefix + a.name, segments=segments,
                                           consumers=[prefix + c for c in a.consumers], result=a.result)
    return renamed
