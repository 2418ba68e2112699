"""`ModelReplica`: one model replica (engine + KV host + transports) as a plain class.

Everything crossing a process boundary is a small picklable record (`RefRecord`) or a transport
handle; KV bytes move only through transports. `cluster.actors` makes this class a Ray actor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from cluster.calibration import Calibration
from cluster.faults import FaultInjection
from cluster.replica_api import Replica
from cluster.sessions import SequenceSessions
from cluster.transfer_endpoint import TransferEndpoint
from operators import EvictionPolicy, FidelityReport, KVHost, KVRef


LENDABLE_CALLS = frozenset({"materialize", "session_prefill", "session_prefill_many", "calibrate_prefill"})  # prefills


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): replicas on one node share its cores."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


@dataclass(frozen=True)
class RefRecord:
    """A KVRef as seen from another process: enough to address it, size it and rebuild it."""

    id: str
    replica: str
    fingerprint: str
    token_ids: tuple[int, ...]
    nbytes: int
    fidelity: FidelityReport | None  # None: exact KV
    computed: int = 0  # tokens the call that made it computed (materialize: prefix-cache hits excluded)

    @property
    def exact(self) -> bool:
        return self.fidelity is None


class ModelReplica(SequenceSessions, FaultInjection, Calibration, TransferEndpoint, Replica):
    """An engine and its KVRefs, addressed by ref id. Not thread-safe: an actor serializes calls."""

    def __init__(self, name: str, model: str, dtype: str = "auto", threads: int | None = None,
                 budget_bytes: int | None = None, **engine_kwargs) -> None:
        """Load `model` (a registry name or HF folder); `engine_kwargs` go to `Engine.from_pretrained`
        (kv_cache_bytes, block_size, prefix_caching, ...)."""
        from aaflow.engine import Engine

        self.name = name
        self.model = model
        self.engine = Engine.from_pretrained(model, dtype=dtype, threads=threads, **engine_kwargs)
        self.host = KVHost(self.engine, name=name, policy=EvictionPolicy(budget_bytes=budget_bytes))
        self._refs: dict[str, KVRef] = {}
        SequenceSessions.__init__(self)
        TransferEndpoint.__init__(self)

    # --- identity -------------------------------------------------------------------------
    def info(self) -> dict:
        return {"name": self.name, "model": self.model, "fingerprint": self.engine.fingerprint,
                "pid": os.getpid(), "node": _node_id(), "bytes_per_token": self.host.spec.bytes_per_token,
                "dtype": str(self.engine.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                "vocab_size": self.engine.config.vocab_size, "model_path": str(self.engine.model_path),
                "block_size": self.engine.kv_layout.block_size, "kv_blocks": self.engine.kv_layout.num_blocks,
                "max_tokens": min(self.engine.config.max_position_embeddings,
                                  self.engine.kv_layout.num_blocks * self.engine.kv_layout.block_size // 4)}

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"used_blocks": s.used, "free_blocks": s.free, "cached_blocks": s.cached,
                "tokens_computed": s.tokens_computed, "tokens_reused": s.tokens_reused, "refs": len(self._refs)}

    def clear_prefix_cache(self) -> None:
        self.engine.clear_prefix_cache()

    def _record(self, ref: KVRef, computed: int = 0) -> RefRecord:
        self._refs[ref.id] = ref
        return RefRecord(ref.id, self.name, ref.fingerprint, ref.token_ids, ref.nbytes, ref.fidelity, computed)

    def _ref(self, ref_id: str) -> KVRef:
        from aaflow.errors import KVRefFreedError

        if ref_id not in self._refs:
            raise KVRefFreedError(f"no KVRef {ref_id} on replica {self.name}: it was freed or never lived here")
        return self._refs[ref_id]

    # --- operators, addressed by ref id ---------------------------------------------------
    def materialize(self, text_or_ids: str | Sequence[int], lineage: bool = True) -> RefRecord:
        from operators import materialize

        before = self.engine.stats().tokens_computed
        ref = materialize(self.host, text_or_ids, lineage=lineage)
        return self._record(ref, self.engine.stats().tokens_computed - before)

    def generate(self, ref_id: str, text_or_ids: str | Sequence[int], max_new_tokens: int = 32, **sampling):
        from aaflow.continuation import generate

        return generate(self._ref(ref_id), text_or_ids, max_new_tokens, **sampling)

    def fork(self, ref_id: str, n: int) -> list[RefRecord]:
        from operators import fork

        return [self._record(r) for r in fork(self._ref(ref_id), n)]

    def compose(self, ref_ids: list[str], mode: str = "exact", r: float = 0.15) -> RefRecord:
        from operators import compose

        return self._record(compose(*[self._ref(i) for i in ref_ids], mode=mode, r=r))

    def pin(self, ref_id: str, ttl_s: float | None = None) -> None:
        self.host.pin(self._ref(ref_id), ttl_s)

    def unpin(self, ref_id: str) -> None:
        self.host.unpin(self._ref(ref_id))

    def evict(self, ref_id: str, spill: bool | None = None) -> None:
        self.host.evict(self._ref(ref_id), spill)

    def free(self, ref_id: str) -> None:
        self.host.free(self._refs.pop(ref_id) if ref_id in self._refs else self._ref(ref_id))

    def with_threads(self, threads: int, method: str, *args, **kwargs):
        """Run one prefill call (one of `LENDABLE_CALLS`) on `threads` torch threads, cores that idle
        replicas of this node lend it (`aaflow.runtime.core_lending`), then go back to this
        replica's own share."""
        if method not in LENDABLE_CALLS:
            raise ValueError(f"only prefill calls run on lent cores ({sorted(LENDABLE_CALLS)}), not {method!r}")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        own = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return getattr(self, method)(*args, **kwargs)
        finally:
            torch.set_num_threads(own)

    def export_tensor(self, ref_id: str) -> torch.Tensor:
        """The ref's KV as one contiguous tensor (for tests and the `ray` object-store path)."""
        ref = self._ref(ref_id)
        return self.engine.export_kv(self.host.sequence(ref)).kv

    def close(self) -> None:
        for sid in list(self._sessions()):
            self.session_close(sid)
        self.host.close()
        self._refs.clear()
        self.close_transports()
