"""The `Replica` interface: what the scheduler and `af.*` call on a model replica, and the lazy
registry of its implementations, one per engine (like the transports' registry).

`aaflow.cluster.replica.ModelReplica` (the built-in engine) and `aaflow.cluster.vllm_replica.VLLMReplica`
implement it on a shared base (`aaflow.cluster.replica_base.ReplicaBase`: identity, faults, and the
session and calibration calls forwarded to components); `Cluster` makes each a Ray actor, whose calls run one at a time. Every method is
blocking on the replica; records and handles cross process boundaries, KV bytes only move
through transports.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Sequence

from aaflow.cluster.step_group_runner import StepStop, run_steps
from aaflow.cluster.transports.registry import best_transport
from aaflow.costmodel.microbench import memcpy_bandwidth
from aaflow.runtime.replies import Exposure, MixedReply, PrefillReply, Received, StepsReply

REPLICAS = {"builtin": "aaflow.cluster.replica:ModelReplica", "vllm": "aaflow.cluster.vllm_replica:VLLMReplica"}
"""Engine name -> the class hosting it, imported on first use (an uninstalled vLLM costs nothing)."""


def replica_class(engine: str) -> type[Replica]:
    """The replica class of `engine` ("builtin" or "vllm"); ValueError naming the choices."""
    if engine not in REPLICAS:
        raise ValueError(f"unknown engine {engine!r}; choose one of {tuple(REPLICAS)}")
    module, name = REPLICAS[engine].split(":")
    return getattr(importlib.import_module(module), name)


def default_transport(engines) -> str:
    """The transport KV moves over between replicas of these engines when none is named: the best
    available here (`aaflow.cluster.transports.registry.best_transport`) that every one of them takes.
    `af.transfer`, `af.run` and `af.plan` all default to it."""
    allowed = None
    for engine in sorted(set(engines)):
        takes = replica_class(engine).transports
        if takes is not None:
            allowed = takes if allowed is None else tuple(t for t in allowed if t in takes)
    return best_transport(allowed)


class Replica(ABC):
    """One model replica: an engine, its KV refs (addressed by id) and its sessions."""

    name: str
    model: str
    engine: object
    transports: tuple[str, ...] | None = None
    """The transports it moves KV over (None: every registered one)."""

    # --- identity ---------------------------------------------------------------------------
    @abstractmethod
    def info(self) -> dict:
        """Name, model, engine, fingerprint, dtype, threads, node, bytes per KV token, limits."""

    @abstractmethod
    def stats(self) -> dict:
        """used_blocks, tokens_computed, tokens_reused, refs (and what else the engine counts)."""

    @abstractmethod
    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix block not in use (benchmarks start cold with it)."""

    def memcpy_bandwidth(self) -> float:
        """In-process copy bandwidth (bytes/s) in this replica: the bound for any transfer into it."""
        return memcpy_bandwidth()

    # --- operators, addressed by ref id ------------------------------------------------------
    @abstractmethod
    def materialize(self, text_or_ids: str | Sequence[int], lineage: bool = True):
        """Prefill a context as a new ref; returns its `RefRecord` (computed: tokens not cached)."""

    @abstractmethod
    def fork(self, ref_id: str, n: int) -> list:
        """n refs sharing the ref's KV."""

    @abstractmethod
    def compose(self, ref_ids: list[str], mode: str = "exact", r: float = 0.15):
        """One ref for the refs' contexts in order (`aaflow.operators.compose`'s rules); its record
        carries the FidelityReport of an approximate compose."""

    @abstractmethod
    def free(self, ref_id: str) -> None:
        """Drop a ref (freeing a freed ref raises KVRefFreedError)."""

    @abstractmethod
    def pin(self, ref_id: str, ttl_s: float | None = None) -> None:
        """Keep a ref's KV from eviction (for `ttl_s` seconds, or until `unpin`)."""

    @abstractmethod
    def unpin(self, ref_id: str) -> None:
        """Let a pinned ref's KV be evicted again."""

    @abstractmethod
    def evict(self, ref_id: str, spill: bool | None = None) -> None:
        """Drop a ref's KV (to disk with `spill`); its next use rebuilds it."""

    @abstractmethod
    def generate(self, ref_id: str, text_or_ids: str | Sequence[int], max_new_tokens: int = 32, **sampling):
        """Continue a ref's context with a prompt and generate; the ref is unchanged."""

    def generate_text(self, text_or_ids: str | Sequence[int], max_new_tokens: int = 32, **sampling):
        """Plain generation from text (the recompute baseline)."""
        return self.engine.generate(text_or_ids, max_new_tokens=max_new_tokens, **sampling)

    # --- transfer ------------------------------------------------------------------------------
    @abstractmethod
    def expose(self, ref_id: str, transport: str) -> Exposure:
        """Make a ref's KV readable by a peer; `release` ends it."""

    @abstractmethod
    def release(self, handle, transport: str) -> None:
        """End an exposure."""

    @abstractmethod
    def receive(self, handle, shape, record, transport: str, timeout_s: float = 30.0) -> Received:
        """Fetch a peer's exposed KV (what its `expose` answered) as a new ref here."""

    # --- sessions (driven by the scheduler, one short call at a time) ---------------------------
    @abstractmethod
    def session_open(self, sid: str, fork_of: str | None = None) -> int:
        """Start a session, empty or continuing a ref; returns its length in tokens."""

    @abstractmethod
    def session_prefill(self, sid: str, token_ids: list[int], sampling=None, reuse_prefix: bool = True,
                        chunk_size: int | None = None) -> PrefillReply:
        """Append prompt tokens: tokens computed and reused, seconds, and the first generated token
        when `sampling` says this completes the prompt."""

    @abstractmethod
    def session_prefill_many(self, requests: list[tuple]) -> list[PrefillReply]:
        """`session_prefill` for each (sid, token_ids, sampling, reuse_prefix), in one call."""

    @abstractmethod
    def session_step(self, sids: list[str]) -> list[int]:
        """One new token per decoding session."""

    def session_steps(self, sids: list[str], steps: int, stops: list) -> StepsReply:
        """Up to `steps` decode steps in one call (`aaflow.cluster.step_group_runner.run_steps`; `stops`: a
        `StepStop` per session): each session's new tokens and each step's end in seconds."""
        return run_steps(self.session_step, sids, steps, [StepStop(*s) for s in stops])

    @abstractmethod
    def session_step_mixed(self, sids: list[str], requests: list[tuple]) -> MixedReply:
        """`session_step(sids)` and `session_prefill_many(requests)` in one call."""

    @abstractmethod
    def session_close(self, sid: str) -> None:
        """End a session and free its KV; closing an unknown or closed session does nothing."""

    @abstractmethod
    def session_count(self) -> int:
        """Sessions open now."""

    @abstractmethod
    def close(self) -> None:
        """Close every session and the engine."""
