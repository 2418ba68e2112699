"""`ModelReplica`: one model replica (engine + KV host + transports) as a plain class.

Everything crossing a process boundary is a small picklable record (`RefRecord`) or a transport
handle; KV bytes move only through transports. `cluster.actors` makes this class a Ray actor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from aaflow.errors import KVImportError, KVTransferError, ModelMismatchError
from cluster.calibration import Calibration
from cluster.faults import FaultInjection
from cluster.sessions import SequenceSessions
from operators import EvictionPolicy, FidelityReport, KVHost, KVPayload, KVRef, Lineage


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


@dataclass(frozen=True)
class KVShape:
    """What a receiver checks before any byte lands: model, geometry and dtype."""

    fingerprint: str
    shape: tuple[int, ...]  # [layers, 2, tokens, kv_heads, head_dim]
    dtype: str


def _round_up(nbytes: int) -> int:
    """Buffer sizes grow in powers of two (at least 1 MiB) so that a few buffers serve every size."""
    return max(2**20, 1 << (nbytes - 1).bit_length())


class ModelReplica(SequenceSessions, FaultInjection, Calibration):
    """An engine and its KVRefs, addressed by ref id. Not thread-safe: an actor serializes calls."""

    def __init__(self, name: str, model: str, dtype: str = "bfloat16", threads: int | None = None,
                 budget_bytes: int | None = None, **engine_kwargs) -> None:
        """Load `model` (a registry name or HF folder); `engine_kwargs` go to `Engine.from_pretrained`
        (kv_cache_bytes, block_size, prefix_caching, ...)."""
        from aaflow.engine import Engine

        self.name = name
        self.model = model
        self.engine = Engine.from_pretrained(model, dtype=dtype, threads=threads, **engine_kwargs)
        self.host = KVHost(self.engine, name=name, policy=EvictionPolicy(budget_bytes=budget_bytes))
        self._refs: dict[str, KVRef] = {}
        self._transports: dict[str, object] = {}
        self._recv_buffers: dict[str, torch.Tensor] = {}  # per transport, reused (registered once)
        self._send_free: dict[str, list[torch.Tensor]] = {}  # idle staging buffers per transport
        self._send_busy: dict[str, torch.Tensor] = {}  # handle id -> staging buffer in use

    # --- identity -------------------------------------------------------------------------
    def info(self) -> dict:
        return {"name": self.name, "model": self.model, "fingerprint": self.engine.fingerprint,
                "pid": os.getpid(), "bytes_per_token": self.host.spec.bytes_per_token,
                "dtype": str(self.engine.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                "vocab_size": self.engine.config.vocab_size, "model_path": str(self.engine.model_path),
                "max_tokens": min(self.engine.config.max_position_embeddings,
                                  self.engine.kv_layout.num_blocks * self.engine.kv_layout.block_size // 4)}

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"used_blocks": s.used, "free_blocks": s.free, "cached_blocks": s.cached,
                "tokens_computed": s.tokens_computed, "tokens_reused": s.tokens_reused, "refs": len(self._refs)}

    def memcpy_bandwidth(self) -> float:
        """In-process copy bandwidth (bytes/s) in this replica: the bound for any transfer into it."""
        from costmodel.microbench import memcpy_bandwidth

        return memcpy_bandwidth()

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
        from operators import generate

        return generate(self._ref(ref_id), text_or_ids, max_new_tokens, **sampling)

    def generate_text(self, text_or_ids: str | Sequence[int], max_new_tokens: int = 32, **sampling):
        """Plain generation from text (the recompute baseline)."""
        return self.engine.generate(text_or_ids, max_new_tokens=max_new_tokens, **sampling)

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

    def export_tensor(self, ref_id: str) -> torch.Tensor:
        """The ref's KV as one contiguous tensor (for tests and the `ray` object-store path)."""
        ref = self._ref(ref_id)
        return self.engine.export_kv(self.host.sequence(ref)).kv

    # --- transfer: source side ------------------------------------------------------------
    def _transport(self, name: str):
        if name not in self._transports:
            from cluster.transports import get_transport

            self._transports[name] = get_transport(name)
        return self._transports[name]

    def _staging_buffer(self, transport: str, nbytes: int) -> torch.Tensor:
        """An idle send buffer of at least `nbytes`, registered with the transport once."""
        idle = self._send_free.setdefault(transport, [])
        for i, buf in enumerate(idle):
            if buf.numel() >= nbytes:
                return idle.pop(i)
        buf = torch.empty(_round_up(nbytes), dtype=torch.uint8)
        self._transport(transport).register_pool(buf)
        return buf

    def expose(self, ref_id: str, transport: str) -> tuple[object, KVShape, RefRecord]:
        """Make the ref's KV readable by a peer; returns (handle, shape to check, record).

        The KV is gathered from the pool once, into a staging buffer that the transport registered
        when it was first allocated and that is reused after `release`.
        """
        ref = self._ref(ref_id)
        lay = self.engine.kv_layout
        shape = (lay.num_layers, 2, len(ref), lay.num_kv_heads, lay.head_dim)
        nbytes = torch.Size(shape).numel() * lay.dtype_bytes
        buf = self._staging_buffer(transport, nbytes)
        staged = buf[:nbytes].view(lay.dtype).view(shape)
        try:
            self.engine.export_kv(self.host.sequence(ref), out=staged)
            handle = self._transport(transport).expose(staged)
        except Exception:
            self._send_free[transport].append(buf)
            raise
        self._send_busy[handle.handle_id] = buf
        kv_shape = KVShape(ref.fingerprint, shape, str(lay.dtype).removeprefix("torch."))
        return handle, kv_shape, self._record(ref)

    def release(self, handle, transport: str) -> None:
        """Stop exposing; the staging buffer goes back to the idle list. Idempotent."""
        self._transport(transport).release(handle)
        buf = self._send_busy.pop(handle.handle_id, None)
        if buf is not None:
            self._send_free[transport].append(buf)

    # --- transfer: destination side -------------------------------------------------------
    def _receive_buffer(self, transport: str, nbytes: int) -> torch.Tensor:
        buf = self._recv_buffers.get(transport)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(_round_up(nbytes), dtype=torch.uint8)
            self._transport(transport).register_pool(buf)
            self._recv_buffers[transport] = buf
        return buf

    def receive(self, handle, shape: KVShape, record: RefRecord, transport: str, timeout_s: float = 30.0):
        """Pull a peer's exposed KV and import it as a new ref here; returns (record, TransferStats).

        The fingerprint, shape and dtype are checked before any byte is received; a failed fetch
        raises `KVTransferError` and leaves this pool exactly as it was.
        """
        self._maybe_fail("receive")
        if shape.fingerprint != self.engine.fingerprint:
            raise ModelMismatchError(
                f"replica {self.name} serves model {self.engine.fingerprint[:12]}..., the KV is of model "
                f"{shape.fingerprint[:12]}...; recompute from text instead"
            )
        lay = self.engine.kv_layout
        expected = (lay.num_layers, 2, len(record.token_ids), lay.num_kv_heads, lay.head_dim)
        dtype = getattr(torch, shape.dtype, None)
        if tuple(shape.shape) != expected or dtype != lay.dtype:
            raise KVImportError(f"incoming KV {shape.shape} {shape.dtype} does not match this replica's "
                                f"{expected} {str(lay.dtype).removeprefix('torch.')}")
        nbytes = torch.Size(expected).numel() * lay.dtype_bytes
        buf = self._receive_buffer(transport, nbytes)[:nbytes]
        try:
            stats = self._transport(transport).fetch(handle, buf, timeout_s=timeout_s)
        except KVTransferError:
            raise
        except Exception as exc:  # noqa: BLE001 - any transport failure becomes one typed error
            raise KVTransferError(f"{transport} transfer to {self.name} failed: {exc}") from exc
        kv = buf.view(lay.dtype).view(expected)
        payload = KVPayload(shape.fingerprint, record.token_ids, kv)
        seq = self.engine.import_kv(payload, cacheable=record.exact)
        lineage = Lineage("transfer", (record.id,), (("from", record.replica), ("transport", transport)))
        return self._record(self.host.register(seq, lineage, record.fidelity)), stats

    def close(self) -> None:
        for sid in list(self._sessions()):
            self.session_close(sid)
        self.host.close()
        self._refs.clear()
        for t in self._transports.values():
            t.close()
        self._transports.clear()
