"""The tally of how replicas that lacked a shared prefix got it, with the cost model's predicted
seconds beside the measured ones, per kind:

* `move:<transport>`: its KV moved from a replica that held it (expose on the source plus receive
  on the destination, each timed from its launch, so queueing behind other calls is not counted);
* `compute`: computed there because the cost model said that ends sooner than a move;
* `first`: computed where no replica had it (no choice to make);
* `recompute-after-failed-move`: a move failed and the destination computed it.

A computation is priced at the tokens it computed (the replica's prefix cache may have had some).

`chosen` counts the moves and computations the cost model decided (an agent whose strategy is the
planner's, with a calibrated profile); a strategy the user named, or no profile, moves unasked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DecisionTally:
    """One kind of decision, summed."""

    count: int = 0
    chosen: int = 0  # of them, decided by the cost model
    tokens: int = 0
    bytes: int = 0
    predicted_s: float = 0.0  # the cost model's seconds, summed over the decisions it priced
    measured_s: float = 0.0  # the seconds they took, summed over the same decisions


class PrefixDecisions:
    """Tallies per kind, summed over a scheduler's life (a cluster's loop serves many runs)."""

    def __init__(self) -> None:
        self.kinds: dict[str, DecisionTally] = {}

    def record(self, kind: str, tokens: int, nbytes: int, predicted_s: float | None, measured_s: float,
               chosen: bool) -> None:
        """One decision of `kind` done (`chosen`: by the cost model); `predicted_s`: the cost model's
        price of it (None without a profile)."""
        tally = self.kinds.setdefault(kind, DecisionTally())
        tally.count, tally.tokens, tally.bytes = tally.count + 1, tally.tokens + tokens, tally.bytes + nbytes
        tally.chosen += chosen
        if predicted_s is not None:
            tally.predicted_s += predicted_s
            tally.measured_s += measured_s

    def snapshot(self) -> dict[str, dict]:
        """{kind: its tally as a dict}, a copy."""
        return {kind: asdict(tally) for kind, tally in list(self.kinds.items())}  # read from other threads


def difference(after: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    """The tallies of what happened between two snapshots (one load on a long-lived loop)."""
    out = {}
    for kind, tally in after.items():
        base = before.get(kind, {})
        delta = {k: v - base.get(k, 0) for k, v in tally.items()}
        if delta["count"]:
            out[kind] = delta
    return out
