"""How to split a machine's cores into replicas for a workflow (`aaflow run --replicas auto`).

Each even split of the cores is a candidate: one replica of each model on all of them, two on
half each, and so on (a replica computes on its share: `af.init` gives each replica
cores / replicas threads). Every candidate is planned on this machine's calibrated profile, whose
compute entries are per thread count, so a replica on two threads is predicted from a replica
measured on two threads. The split whose plan (the planner's choice of strategies for that split)
has the shortest predicted makespan wins; ties go to fewer replicas (less memory, no transfers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from aaflow.cluster.calibration import ensure_profile
from aaflow.common.errors import CostModelError
from aaflow.cluster.planning import plan, replica_infos
from aaflow.cluster.cluster import init
from aaflow.costmodel.profile_store import covers, find_profile


@dataclass(frozen=True)
class SplitChoice:
    """The replicas per model chosen for a workflow, and the predicted makespan of every split."""

    replicas: int
    """Replicas of each model."""
    predicted_s: dict[int, float] = field(default_factory=dict)
    """Replicas per model -> predicted makespan (s) of the planner's plan for that split."""
    plans: dict[int, object] = field(default_factory=dict)
    """Replicas per model -> that split's `Plan`."""

    def explain(self) -> str:
        rows = [f"  {n} replica(s) per model: predicted {s:.2f} s" + ("  <- chosen" if n == self.replicas else "")
                for n, s in sorted(self.predicted_s.items())]
        return "core split, predicted by the planner on this machine's profile:\n" + "\n".join(rows)


def candidate_splits(models: int, cores: int | None = None) -> list[int]:
    """Replicas per model that split `cores` evenly (every replica at least one core)."""
    cores = cores or os.cpu_count() or 1
    return [n for n in range(1, cores // models + 1) if cores % (n * models) == 0] or [1]


def choose_split(workflow, dtype: str = "auto", hardware=None,
                 progress: Callable[[str], None] | None = None) -> SplitChoice:
    """Plan `workflow` for each even split of this machine's cores (see the module docstring) and
    return the fastest predicted. Raises `CostModelError` naming the fix when the profile lacks an
    entry for a split's thread count (`aaflow calibrate --replicas N` measures it; `aaflow run
    --replicas auto` does it by itself)."""
    models = sorted({a.model for a in workflow.agents()})
    predicted, plans = {}, {}
    for n in candidate_splits(len(models)):
        try:
            chosen = plan(workflow, {m: n for m in models}, hardware=hardware, dtype=dtype, progress=progress)
        except CostModelError as exc:
            raise CostModelError(f"cannot predict {n} replica(s) per model: {exc}; measure that split with "
                                 f"`aaflow calibrate --replicas {n}`") from exc
        plans[n], predicted[n] = chosen, chosen.predicted.makespan_s
    best = min(predicted, key=lambda n: (round(predicted[n], 3), n))
    return SplitChoice(best, predicted, plans)


def calibrate_splits(workflow, dtype: str = "auto", progress: Callable[[str], None] | None = print) -> None:
    """Measure the splits this machine's profile lacks: start each such split's replicas, calibrate
    (quick, saved to the profile cache, as `af.run` does on first use) and stop them."""
    models = sorted({a.model for a in workflow.agents()})
    for n in candidate_splits(len(models)):
        split = {m: n for m in models}
        if covers(find_profile(), replica_infos(split, dtype)):
            continue
        if progress is not None:
            progress(f"calibrating {n} replica(s) per model (once per machine) ...")
        cluster = init(replicas=split, dtype=dtype)
        try:
            ensure_profile(cluster, progress=progress)
        finally:
            cluster.shutdown()
