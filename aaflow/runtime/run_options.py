"""A run's own scheduling options, carried by each of its agents into the one loop of a deployment.

A deployment has one scheduling loop whatever its runs ask for: runs with different options share
its KV reservation, its decode steps and its prefix cache, and each option applies to the run that
set it (`af.start`'s arguments of the same names).
"""

from __future__ import annotations

from dataclasses import dataclass

from aaflow.common.errors import InvalidArgumentError

PREFIX_FETCH = ("auto", "move", "compute")


def check_prefix_fetch(value) -> None:
    """`InvalidArgumentError` unless `value` is one of `PREFIX_FETCH`."""
    if value not in PREFIX_FETCH:
        raise InvalidArgumentError(f"prefix_fetch must be one of {', '.join(PREFIX_FETCH)}, got {value!r}")


@dataclass(frozen=True)
class RunOptions:
    """`chunk_tokens`: streamed upstream tokens are prefilled downstream in chunks of at least this
    many; `call_timeout_s`: the longest a replica call of this run's agents may take before the run
    fails; `transport`: what its shared prefixes move over (None: the backend's default);
    `lend_cores`: its long prefills may borrow the threads of idle replicas of their node;
    `prefix_fetch`: how a replica that lacks a shared prefix of the run's agents gets it, one of
    `PREFIX_FETCH`: "auto" (the cost model chooses, for agents the planner placed; moved otherwise),
    "move" (always moved from a replica that holds it) or "compute" (always computed there)."""

    chunk_tokens: int = 16
    call_timeout_s: float = 300.0
    transport: str | None = None
    lend_cores: bool = True
    prefix_fetch: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_tokens", max(1, int(self.chunk_tokens)))
        if not self.call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, got {self.call_timeout_s!r}")
        check_prefix_fetch(self.prefix_fetch)
