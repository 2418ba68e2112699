"""Move or compute: where a replica that lacks a shared prefix gets it, asked of the cost model.

A prefix that another replica holds can be moved from there (the transfer operator); one that
another replica is still computing can be waited for and then moved; or the replica that needs it
computes it itself. Placement sends an agent to an idle replica when the one holding its prefix is
loaded; `PrefixCosts` then says which of the three ends sooner there, from the calibrated hardware
profile: computing pays where the link is slow (a move of the KV takes longer than its prefill) or
where the holder has much of its prefill still to do. Waiting, this replica idles and lends its
cores to the holder's prefill (`lent_core_speedup` faster); computing, both replicas compute at
once, each a little slower (`concurrency_slowdown`).

The choice is made only for agents whose strategy the planner chose (`strategy="auto"`); a
strategy the user named ("transfer") is followed as named. Without a profile
(`Backend.prefix_costs` answers None) a prefix is always moved from where it is or will be.
"""

from __future__ import annotations

from dataclasses import dataclass

from aaflow.costmodel.hardware import ComputeProfile, HardwareProfile, LinkProfile
from aaflow.costmodel.model_profile import ModelProfile

SOONER_BY = 0.10  # computing must end this much sooner (relative) to be chosen: it doubles the prefix's
# work, which a loaded cluster needs more than a few percent of one fetch (the planner's bar for
# choosing anything over text, MIN_GAIN_OVER_TEXT, is the same)


@dataclass(frozen=True)
class PrefixCosts:
    """Seconds to compute a prefix on one replica of its model, or to move its KV between two."""

    compute: dict[str, ComputeProfile]  # model -> one replica's compute
    kv_bytes_per_token: dict[str, int]  # model -> KV bytes per token
    link: LinkProfile
    memcpy_bytes_per_s: float
    concurrency_slowdown: float = 1.0
    lent_core_speedup: float = 1.0

    @classmethod
    def of(cls, hardware: HardwareProfile, models: dict[str, ModelProfile], link: str) -> PrefixCosts:
        """The costs of `models` (served model -> its profile) on `hardware`, moved over `link`."""
        return cls({m: hardware.compute_for(p) for m, p in models.items()},
                   {m: p.kv_bytes_per_token for m, p in models.items()}, hardware.link(link),
                   hardware.memcpy_bytes_per_s, hardware.concurrency_slowdown, hardware.lent_core_speedup)

    def compute_s(self, model: str, tokens: int) -> float:
        """One prefill of `tokens` from nothing."""
        return self.compute[model].prefill_time(tokens)

    def move_s(self, model: str, tokens: int) -> float:
        """The source copying the KV of `tokens` out (unless the link reads it in place) and the link moving it."""
        nbytes = tokens * self.kv_bytes_per_token[model]
        return self.link.source_copy_time(nbytes, self.memcpy_bytes_per_s) + self.link.transfer_time(nbytes)

    def ready_in_s(self, model: str, tokens: int, elapsed_s: float) -> float:
        """Seconds until a replica that started computing the prefix `elapsed_s` ago has it, on the
        cores the replicas waiting for it lend."""
        return max(0.0, self.compute_s(model, tokens) / self.lent_core_speedup - elapsed_s)

    def compute_here(self, model: str, tokens: int, holder_ready_in_s: float) -> bool:
        """Whether computing a prefix of `tokens` here ends before the holder has it
        (`holder_ready_in_s` from now: 0 when it holds it already) and moves it here, by more than
        `SOONER_BY`. A holder still computing shares the machine with this computation, which then
        runs slower."""
        if model not in self.compute or tokens <= 0:
            return False
        slowdown = self.concurrency_slowdown if holder_ready_in_s > 0 else 1.0
        return self.compute_s(model, tokens) * slowdown * (1 + SOONER_BY) < holder_ready_in_s + self.move_s(model, tokens)
