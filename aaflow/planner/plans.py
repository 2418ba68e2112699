"""A planner's answer: one strategy per agent, its predicted run, and why."""

from __future__ import annotations

from dataclasses import dataclass, field

from aaflow.planner.simulate import SimResult
from aaflow.common.strategies import STREAMS
from aaflow.costmodel.units import format_seconds
from aaflow.costmodel.workflow_spec import WorkflowSpec


def format_bytes(nbytes: float) -> str:
    """A human-readable size in decimal units: "12.3 MB"."""
    for factor, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(nbytes) >= factor:
            return f"{nbytes / factor:.3g} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class Plan:
    """The strategy chosen for each agent, with the simulated prediction it rests on.

    `predicted` never has a longer makespan than `baseline` (uniform "text"): when nothing beats
    text, the plan is text for every agent.
    """

    workflow: WorkflowSpec
    decisions: dict[str, str]
    """Agent name -> strategy ("text", "recompute", "transfer", "stream", "transfer+stream")."""
    predicted: SimResult
    """Simulation of `decisions`."""
    baseline: SimResult
    """Simulation of uniform "text" (plain text passing)."""
    alternatives: dict[str, SimResult] = field(default_factory=dict)
    """Simulation of each uniform candidate strategy."""
    runner_up: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Agent -> (best other strategy for it, predicted makespan in s with the rest of the plan kept)."""
    hardware_name: str = ""
    projection: bool = True
    """True when the hardware profile was not measured on this machine (public figures)."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Agent -> a short sentence on why its strategy pays (or what it costs)."""

    @property
    def speedup(self) -> float:
        """Predicted text makespan / plan makespan (>= 1)."""
        return self.baseline.makespan_s / self.predicted.makespan_s if self.predicted.makespan_s else 1.0

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer, consumer, strategy) rows. Each agent's context edge comes first, its producer
        "prefix:<prefix key>" and its strategy how the prefix KV arrives ("reuse": another agent on
        the same replica had it; "transfer": from another replica; "recompute": computed here); then one
        row per upstream agent, "stream" (prefilled while the upstream decodes) or "wait"."""
        rows = []
        for task in self.workflow.agents:
            timing = self.predicted.agents[task.name]
            rows.append((f"prefix:{task.prefix_key}", task.name, timing.prefix_via or "recompute"))
            mode = "stream" if self.decisions[task.name] in STREAMS else "wait"
            rows.extend((up, task.name, mode) for up in task.upstream)
        return rows

    def explain(self) -> str:
        """A fixed-width table: per agent its replica, strategy, predicted first token and end,
        prefill tokens computed, runner-up and why; a header with hardware and totals."""
        pred, base = self.predicted, self.baseline
        label = "PROJECTION (not measured here)" if self.projection else "measured"
        lines = [
            f"plan for workflow {self.workflow.name!r} on {self.hardware_name}: {label}",
            f"predicted makespan {format_seconds(pred.makespan_s)} vs text {format_seconds(base.makespan_s)} "
            f"({self.speedup:.2f}x); prefill tokens computed {pred.prefill_tokens_computed:,} vs "
            f"{base.prefill_tokens_computed:,}; KV moved {format_bytes(pred.bytes_moved)}; "
            f"peak KV {format_bytes(pred.peak_kv_bytes)} vs {format_bytes(base.peak_kv_bytes)}",
        ]
        header = ("agent", "replica", "strategy", "first token", "end", "prefill", "runner-up", "why")
        rows = [header]
        for task in self.workflow.agents:
            t = pred.agents[task.name]
            other = self.runner_up.get(task.name)
            rows.append((task.name, t.replica, self.decisions[task.name], format_seconds(t.first_token_s),
                         format_seconds(t.end_s), f"{t.prefill_computed_tokens:,}",
                         f"{other[0]} {format_seconds(other[1])}" if other else "-",
                         self.reasons.get(task.name, "")))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        for row in rows:
            cells = [cell.rjust(w) if i in (3, 4, 5) else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells + [row[-1]]).rstrip())
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready: decisions, predictions (seconds, tokens, bytes), runner-ups, edges, reasons."""
        return {
            "workflow": self.workflow.name,
            "hardware": self.hardware_name,
            "projection": self.projection,
            "decisions": dict(self.decisions),
            "speedup_vs_text": self.speedup,
            "predicted": self.predicted.to_dict(),
            "baseline": self.baseline.to_dict(),
            "alternatives": {k: v.to_dict() for k, v in self.alternatives.items()},
            "runner_up": {k: {"strategy": s, "makespan_s": m} for k, (s, m) in self.runner_up.items()},
            "edges": [{"producer": p, "consumer": c, "strategy": s} for p, c, s in self.edges()],
            "reasons": dict(self.reasons),
        }
