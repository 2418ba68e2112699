"""`ReplicaBase`: what every replica does the same way, whatever its engine.

A replica is made of components it owns, each with its own state: its refs (`refs`), its
sessions (`sessions`), its fault injection (`faults`), its calibration microbenchmarks
(`calibration`) and, for the built-in engine, its transfer endpoint. The base holds the replica's
identity and forwards the session, fault and calibration calls to them; the Ray actor's method
names stay those of the `Replica` interface.
"""

from __future__ import annotations

import os

import ray

from aaflow.cluster.replica_microbench import QUICK_DECODE, QUICK_PREFILL
from aaflow.cluster.faults import FaultInjection
from aaflow.cluster.replica_api import Replica
from aaflow.runtime.calls import Call
from aaflow.runtime.replies import MixedReply, PrefillReply


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): replicas on one node share its cores."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class ReplicaBase(Replica):
    """Identity, faults and the calls forwarded to components. A subclass sets `engine`, `refs`
    (with `len` and `clear`), `sessions` and `calibration` in its `__init__`."""

    engine_name = ""  # the `replica_api.REPLICAS` key of the subclass

    def __init__(self, name: str, model: str) -> None:
        self.name, self.model = name, model
        self.faults = FaultInjection()

    # --- the one entry point ----------------------------------------------------------------
    def run(self, call: Call):
        """Run one typed call (`aaflow.runtime.calls`): the method its kind names, on its fields,
        on `call.threads` lent threads where it asks for them (built-in prefills). What travels to
        a replica actor is the call itself; its answer is the call's `Reply`."""
        if not isinstance(call, Call):
            raise TypeError(f"a replica runs a Call (aaflow.runtime.calls), not {type(call).__name__}")
        if call.threads:
            return self.with_threads(call.threads, call.method, *call.arguments(), **call.keywords())
        return getattr(self, call.method)(*call.arguments(), **call.keywords())

    def with_threads(self, threads: int, method: str, *args, **kwargs):
        """Run a call on lent threads: only a built-in replica lends (`ModelReplica.with_threads`)."""
        raise ValueError(f"replica {self.name} ({self.engine_name}) runs no call on lent threads")

    # --- identity ---------------------------------------------------------------------------
    def info(self) -> dict:
        """Name, model, engine, fingerprint, process, node, dtype, vocabulary and model folder, and
        what the engine adds (`_engine_info`: bytes per KV token, threads, limits)."""
        return {"name": self.name, "model": self.model, "engine": self.engine_name,
                "fingerprint": self.engine.fingerprint, "pid": os.getpid(), "node": _node_id(),
                "dtype": str(self.engine.dtype).removeprefix("torch."), "vocab_size": self.engine.config.vocab_size,
                "model_path": str(self.engine.model_path), **self._engine_info()}

    def _engine_info(self) -> dict:
        """The engine's part of `info`: bytes_per_token, threads, max_tokens and its own keys."""
        raise NotImplementedError

    # --- faults (reliability tests) -----------------------------------------------------------
    def inject_fault(self, kind: str, after: int = 1, at: str | None = None, delay_s: float = 0.0,
                     claim: str | None = None) -> None:
        """Arm a fault (`aaflow.cluster.faults.FaultInjection`): "crash", "error", "transfer", "stale", or
        "kill" at a point (materialize, prefill, step, expose, receive), for one replica of those
        armed with the same `claim` file."""
        self.faults.inject(kind, after, at, delay_s, claim)

    def clear_fault(self) -> None:
        """Disarm whatever fault is armed."""
        self.faults.clear()

    # --- sessions ---------------------------------------------------------------------------------
    def session_open(self, sid: str, fork_of: str | None = None) -> int:
        return self.sessions.session_open(sid, fork_of)

    def session_prefill(self, sid: str, token_ids: list[int], sampling=None, reuse_prefix: bool = True,
                        chunk_size: int | None = None) -> PrefillReply:
        return self.sessions.session_prefill(sid, token_ids, sampling, reuse_prefix, chunk_size)

    def session_prefill_many(self, requests: list[tuple]) -> list[PrefillReply]:
        return self.sessions.session_prefill_many(requests)

    def session_step(self, sids: list[str]) -> list[int]:
        return self.sessions.session_step(sids)

    def session_step_mixed(self, sids: list[str], requests: list[tuple]) -> MixedReply:
        return self.sessions.session_step_mixed(sids, requests)

    def session_close(self, sid: str) -> None:
        self.sessions.session_close(sid)

    def session_count(self) -> int:
        return self.sessions.session_count()

    # --- calibration (`aaflow.cluster.calibration` fits a hardware profile to these samples) --------------
    def calibrate_prefill(self, points=None, repeats: int = 1) -> list[tuple[int, int, float]]:
        """(new tokens, context tokens, seconds) per point (default `QUICK_PREFILL`)."""
        return self.calibration.calibrate_prefill(QUICK_PREFILL if points is None else points, repeats)

    def calibrate_decode(self, points=None, steps: int = 12) -> list[tuple[int, int, float]]:
        """(batch, context tokens, seconds per step) per point (default `QUICK_DECODE`)."""
        return self.calibration.calibrate_decode(QUICK_DECODE if points is None else points, steps)

    def calibrate_packing(self) -> list[tuple[int, int, int, float]]:
        """(members, new tokens each, context tokens each, seconds) of packed prefills of 1 and many sequences."""
        return self.calibration.calibrate_packing()

    def calibrate_receive(self, handle, shape, record, transport: str) -> tuple[int, float]:
        """Time a whole `receive` of a peer's exposed KV and drop what arrived: (bytes, seconds)."""
        return self.calibration.calibrate_receive(handle, shape, record, transport)

    # --- end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every session, drop every ref, then close the engine's side (`_close_engine`)."""
        self.sessions.close_all()
        self.refs.clear()
        self._close_engine()

    def _close_engine(self) -> None:
        """Close what the engine holds (pool, transports, child process)."""
