"""`ModelReplica`: one built-in-engine replica (engine + KV host + transports) as a plain class.

Everything crossing a process boundary is a small picklable record (`RefRecord`) or a transport
handle; KV bytes move only through transports. `aaflow.cluster.actors` makes this class a Ray actor.
"""

from __future__ import annotations

from typing import Sequence

import torch

from aaflow.cluster.continuation import generate
from aaflow.engine import Engine
from aaflow.cluster.replica_microbench import Calibration
from aaflow.cluster.ref_table import RefTable
from aaflow.runtime.replies import Exposure, Received, RefRecord
from aaflow.cluster.replica_base import ReplicaBase
from aaflow.cluster.sessions import SequenceSessions
from aaflow.cluster.transfer_endpoint import TransferEndpoint
from aaflow.operators import EvictionPolicy, KVHost, compose, fork, materialize

__all__ = ["LENDABLE_CALLS", "ModelReplica", "RefRecord"]

LENDABLE_CALLS = frozenset({"materialize", "session_prefill", "session_prefill_many", "calibrate_prefill"})  # prefills


class ModelReplica(ReplicaBase):
    """An engine and its KVRefs, addressed by ref id. Not thread-safe: an actor serializes calls."""

    engine_name = "builtin"

    def __init__(self, name: str, model: str, dtype: str = "auto", threads: int | None = None,
                 budget_bytes: int | None = None, **engine_kwargs) -> None:
        """Load `model` (a registry name or HF folder); `engine_kwargs` go to `Engine.from_pretrained`
        (kv_cache_bytes, block_size, prefix_caching, ...)."""
        super().__init__(name, model)
        self.engine = Engine.from_pretrained(model, dtype=dtype, threads=threads, **engine_kwargs)
        self.host = KVHost(self.engine, name=name, policy=EvictionPolicy(budget_bytes=budget_bytes))
        self.refs = RefTable(name)
        self.sessions = SequenceSessions(self.engine, self.host, self.refs, self.faults)
        self.endpoint = TransferEndpoint(name, self.engine, self.host, self.refs, self.faults)
        self.calibration = Calibration(self)

    # --- identity -------------------------------------------------------------------------
    def _engine_info(self) -> dict:
        lay = self.engine.kv_layout
        return {"bytes_per_token": self.host.spec.bytes_per_token, "threads": torch.get_num_threads(),
                "block_size": lay.block_size, "kv_blocks": lay.num_blocks,
                "prefix_caching": self.engine.runner.prefix_caching,
                "max_tokens": min(self.engine.config.max_position_embeddings, lay.num_blocks * lay.block_size // 4)}

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"used_blocks": s.used, "free_blocks": s.free, "cached_blocks": s.cached,
                "tokens_computed": s.tokens_computed, "tokens_reused": s.tokens_reused, "refs": len(self.refs)}

    def clear_prefix_cache(self) -> None:
        self.engine.clear_prefix_cache()

    # --- operators, addressed by ref id ---------------------------------------------------
    def materialize(self, text_or_ids: str | Sequence[int], lineage: bool = True) -> RefRecord:
        self.faults.reached("materialize")
        before = self.engine.stats().tokens_computed
        ref = materialize(self.host, text_or_ids, lineage=lineage)
        return self.refs.add(ref, self.engine.stats().tokens_computed - before)

    def generate(self, ref_id: str, text_or_ids: str | Sequence[int], max_new_tokens: int = 32, **sampling):
        return generate(self.refs.get(ref_id), text_or_ids, max_new_tokens, **sampling)

    def fork(self, ref_id: str, n: int) -> list[RefRecord]:
        return [self.refs.add(r) for r in fork(self.refs.get(ref_id), n)]

    def compose(self, ref_ids: list[str], mode: str = "exact", r: float = 0.15) -> RefRecord:
        return self.refs.add(compose(*[self.refs.get(i) for i in ref_ids], mode=mode, r=r))

    def pin(self, ref_id: str, ttl_s: float | None = None) -> None:
        self.host.pin(self.refs.get(ref_id), ttl_s)

    def unpin(self, ref_id: str) -> None:
        self.host.unpin(self.refs.get(ref_id))

    def evict(self, ref_id: str, spill: bool | None = None) -> None:
        self.host.evict(self.refs.get(ref_id), spill)

    def free(self, ref_id: str) -> None:
        self.host.free(self.refs.pop(ref_id))

    def export_tensor(self, ref_id: str) -> torch.Tensor:
        """The ref's KV as one contiguous tensor (for tests and the `ray` object-store path)."""
        return self.engine.export_kv(self.host.sequence(self.refs.get(ref_id))).kv

    # --- transfer (`aaflow.cluster.transfer_endpoint`) ------------------------------------------------
    def expose(self, ref_id: str, transport: str) -> Exposure:
        return self.endpoint.expose(ref_id, transport)

    def release(self, handle, transport: str) -> None:
        self.endpoint.release(handle, transport)

    def receive(self, handle, shape, record, transport: str, timeout_s: float = 30.0) -> Received:
        return self.endpoint.receive(handle, shape, record, transport, timeout_s)

    # --- lent cores ----------------------------------------------------------------------------
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

    def _close_engine(self) -> None:
        self.host.close()
        self.endpoint.close()
