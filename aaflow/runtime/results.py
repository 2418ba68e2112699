"""What `af.run` returns: each agent's text, tokens and metrics, and the run's totals."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class AgentResult:
    """One agent's output and how it was produced.

    Times are seconds since the run started. `handoff_gap_s` is this agent's first token minus
    the last token of its latest-finishing upstream agent (None without upstream agents).
    """

    name: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    replica: str = ""
    strategy: str = ""
    first_token_s: float | None = None
    last_token_s: float | None = None
    handoff_gap_s: float | None = None
    prompt_tokens: int = 0
    prefill_computed: int = 0  # prompt tokens computed by a forward pass on the replica
    prefill_reused: int = 0  # prompt tokens served by shared KV (fork, transfer, prefix cache)
    streamed_tokens: int = 0  # upstream tokens prefilled while the upstream was still decoding
    decoded: int = 0
    bytes_moved: int = 0
    restarts: int = 0
    input_order: list[str] = field(default_factory=list)  # upstream agents in prompt order (unordered: by completion)
    fidelity: object = None  # a FidelityReport when its prefix is composed approximately (None: exact KV)


@dataclass
class RunResult:
    """`res[name]` is an `AgentResult`; `res.metrics` the run's totals and per-agent rows."""

    workflow: str
    strategy: str
    agents: dict[str, AgentResult]
    wall_s: float
    events: list[str] = field(default_factory=list)
    shared_prefill_computed: int = 0  # tokens computed once to materialize prefixes that agents share
    planning_s: float = 0.0  # spent planning before the run (strategy "auto" without a given plan; not in wall_s)
    total_s: float = 0.0  # the whole `af.run` call: prompts tokenized, planning, the run (end to end, as a user waits)

    def __getitem__(self, name: str) -> AgentResult:
        return self.agents[name]

    @property
    def metrics(self) -> dict:
        rows = {n: asdict(a) for n, a in self.agents.items()}
        for row in rows.values():
            row.pop("token_ids")
            row.pop("text")
        return {
            "workflow": self.workflow, "strategy": self.strategy, "wall_s": self.wall_s, "planning_s": self.planning_s,
            "total_s": self.total_s,
            "prefill_computed": sum(a.prefill_computed for a in self.agents.values()) + self.shared_prefill_computed,
            "shared_prefill_computed": self.shared_prefill_computed,
            "prefill_reused": sum(a.prefill_reused for a in self.agents.values()),
            "streamed_tokens": sum(a.streamed_tokens for a in self.agents.values()),
            "bytes_moved": sum(a.bytes_moved for a in self.agents.values()),
            "agents": rows,
        }

    def summary(self) -> str:
        """A readable table, one row per agent."""
        head = f"{'agent':<12} {'replica':<12} {'strategy':<9} {'first tok':>9} {'gap':>7} {'computed':>8} " \
               f"{'reused':>7} {'streamed':>8} {'decoded':>7}"
        lines = [f"workflow {self.workflow!r}, strategy {self.strategy}: {self.wall_s:.2f} s", head]
        for a in self.agents.values():
            gap = f"{a.handoff_gap_s:.3f}" if a.handoff_gap_s is not None else "-"
            lines.append(f"{a.name:<12} {a.replica:<12} {a.strategy:<9} {a.first_token_s or 0:>9.3f} {gap:>7} "
                         f"{a.prefill_computed:>8} {a.prefill_reused:>7} {a.streamed_tokens:>8} {a.decoded:>7}")
        return "\n".join(lines)
