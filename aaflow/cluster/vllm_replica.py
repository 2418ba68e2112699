"""`VLLMReplica`: a model replica on vLLM with the `Replica` interface (sessions, refs, transfer).

KV refs are aaflow KV payloads (`KVExport`, [layers, 2, n, kv_heads, head_dim]) held in this
process: `materialize` prefills on vLLM and reads the KV back through the aaflow connector;
`receive` keeps the incoming payload. A payload enters vLLM's cache through the connector when a
session that continues it (`session_open(sid, fork_of=ref)`) sends its first request. Compose
(exact, rerotate) and evict work on the payloads (`aaflow.cluster.payload_refs`); calibration runs
through sessions' requests (`aaflow.cluster.vllm_microbench`). Sessions map to vLLM requests
(`aaflow.cluster.vllm_sessions`).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from aaflow.engine.rope import RotaryTable
from aaflow.engine.sequence import KVExport
from aaflow.engines_vllm import VLLMEngine
from aaflow.engines_vllm.errors import VLLMUnsupportedError
from aaflow.common.errors import KVComposeError
from aaflow.cluster.payload_refs import PayloadRefs
from aaflow.runtime.replies import Exposure, Received, RefRecord
from aaflow.cluster.replica_base import ReplicaBase
from aaflow.cluster.receive_checks import KVShape, ReceiverGeometry, as_transfer_error, check_incoming
from aaflow.cluster.transports import get_transport
from aaflow.cluster.vllm_microbench import VLLMCalibration
from aaflow.cluster.vllm_sessions import VLLMSessions
from aaflow.operators.compose import join_parts
from aaflow.operators.fork import check_fork_count
from aaflow.operators.ref import FidelityReport

VLLM_OPTIONS = ("prefix_caching", "max_model_len", "kv_cache_gib", "block_size", "enforce_eager", "python",
                "startup_timeout_s")


class VLLMReplica(ReplicaBase):
    """A vLLM engine (child process) and its KV refs, addressed by ref id. One caller at a time."""

    transports = ("ray",)
    engine_name = "vllm"

    def __init__(self, name: str, model: str, dtype: str = "bfloat16", threads: int | None = None,
                 budget_bytes: int | None = None, **vllm_kwargs) -> None:
        """Start vLLM on `model`. `vllm_kwargs` go to `VLLMEngine.from_pretrained` (see VLLM_OPTIONS);
        `threads` and `budget_bytes` are the built-in replica's and are not used here.

        Raises:
            VLLMUnavailableError: vLLM is missing or failed to start (names the fix).
            TypeError: an option vLLM replicas do not take.
        """
        unknown = sorted(set(vllm_kwargs) - set(VLLM_OPTIONS))
        if unknown:
            raise TypeError(f"vLLM replicas take {VLLM_OPTIONS}, not {unknown}")
        super().__init__(name, model)
        self.engine = VLLMEngine.from_pretrained(model, dtype=dtype, **vllm_kwargs)
        self.refs = PayloadRefs(name, self.engine.fingerprint, self.engine.export_kv)
        self.sessions = VLLMSessions(name, self.engine, self.refs, self.faults)
        self.calibration = VLLMCalibration(self)
        self._transports: dict[str, object] = {}
        self._ids = itertools.count()
        self._rotary = None  # made on the first rerotate compose

    # --- identity -------------------------------------------------------------------------
    def _engine_info(self) -> dict:
        """vLLM's own info under "vllm"; no threads of its own to report (vLLM has its process)."""
        c = self.engine.config
        dtype_bytes = torch.empty(0, dtype=self.engine.dtype).element_size()
        vinfo = self.engine.info
        return {"bytes_per_token": c.num_layers * 2 * c.num_kv_heads * c.head_dim * dtype_bytes, "threads": None,
                "max_tokens": min(c.max_position_embeddings, vinfo.get("max_model_len", c.max_position_embeddings)),
                "vllm": vinfo}

    def stats(self) -> dict:
        """used_blocks: vLLM blocks held by open requests (prefix-cached free blocks are not used)."""
        s = self.engine.server_stats()
        return {"used_blocks": s["used_blocks"], "free_blocks": None, "cached_blocks": None,
                "tokens_computed": self.sessions.computed, "tokens_reused": self.sessions.reused, "refs": len(self.refs),
                "requests": s["running"]}

    def clear_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def _record(self, payload: KVExport, fidelity=None, lineage: bool = True) -> RefRecord:
        ref_id = f"{self.name}:v{next(self._ids)}"
        self.refs.add(ref_id, payload, fidelity, lineage)
        return self._record_of(ref_id)

    def _record_of(self, ref_id: str) -> RefRecord:
        payload = self.refs.get(ref_id)
        return RefRecord(ref_id, self.name, payload.fingerprint, tuple(payload.token_ids),
                         payload.kv.numel() * payload.kv.element_size(), self.refs.fidelity(ref_id))

    def _ref(self, ref_id: str) -> KVExport:
        return self.refs.get(ref_id)

    # --- operators --------------------------------------------------------------------------
    def materialize(self, text_or_ids: str | Sequence[int], lineage: bool = True) -> RefRecord:
        """Prefill on vLLM and keep the prompt's KV as a payload ref (exact; lineage is the token ids)."""
        return self._record(self.engine.export_kv(text_or_ids), lineage=lineage)

    def generate(self, ref_id: str, text_or_ids: str | Sequence[int], max_new_tokens: int = 32, **sampling):
        """Continue a ref with a prompt (its KV is loaded through the connector) and generate."""
        payload = self._ref(ref_id)
        suffix = self.engine.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        return self.engine.generate(list(payload.token_ids) + suffix, max_new_tokens, kv=payload, **sampling)

    def fork(self, ref_id: str, n: int) -> list[RefRecord]:
        """n refs sharing the payload (payloads are immutable)."""
        check_fork_count(n)
        payload = self._ref(ref_id)
        return [self._record(payload, self.refs.fidelity(ref_id)) for _ in range(n)]

    def compose(self, ref_ids: list[str], mode: str = "exact", r: float = 0.15) -> RefRecord:
        """`exact` and `rerotate` compose of payloads here (the rules of `aaflow.operators.compose`). `blend`
        recomputes chosen tokens layer by layer inside the engine, which vLLM does not expose: refused."""
        if mode == "blend":
            raise VLLMUnsupportedError(f"compose mode 'blend' is not supported on vLLM replica {self.name}: use "
                                       "'rerotate' here, or blend on a built-in replica and transfer the result")
        if mode not in ("exact", "rerotate"):
            raise KVComposeError(f"unknown compose mode {mode!r}: use 'exact', 'rerotate' or 'blend'")
        parts = [(i, self._ref(i).token_ids, self._ref(i).kv) for i in ref_ids]
        if self._rotary is None:  # the built-in engine's RoPE: the payload format is the same

            self._rotary = RotaryTable(self.engine.config, self.engine.dtype)
        tokens, kv, moved = join_parts(parts, mode, self._rotary.shift_kv)
        fidelity = FidelityReport(mode, total_tokens=len(tokens)) if moved else None
        return self._record(KVExport(self.engine.fingerprint, tuple(tokens), kv), fidelity)

    def pin(self, ref_id: str, ttl_s: float | None = None) -> None:
        """Accepted for any live ref: this replica has no byte budget, so only `evict` drops payloads."""
        self.refs.require(ref_id)

    unpin = pin

    def evict(self, ref_id: str, spill: bool | None = None) -> None:
        """Drop the payload (to disk if `spill`); the next use reloads it or recomputes it on vLLM."""
        self.refs.evict(ref_id, bool(spill))

    def free(self, ref_id: str) -> None:
        self.refs.free(ref_id)

    def export_tensor(self, ref_id: str) -> torch.Tensor:
        return self._ref(ref_id).kv

    # --- transfer -----------------------------------------------------------------------------
    def _transport(self, name: str):
        if name.split("@")[0] != "ray":
            raise VLLMUnsupportedError(f"vLLM replica {self.name} moves KV over the 'ray' transport only, "
                                       f"not {name!r}: pass transport='ray'")
        if name not in self._transports:
            self._transports[name] = get_transport(name)
        return self._transports[name]

    def expose(self, ref_id: str, transport: str) -> Exposure:
        """Make the ref's payload readable by a peer: its handle, the shape to check, its record."""
        payload = self._ref(ref_id)
        handle = self._transport(transport).expose(payload.kv.contiguous())
        shape = KVShape(payload.fingerprint, tuple(payload.kv.shape), str(payload.kv.dtype).removeprefix("torch."))
        return Exposure(handle, shape, self._record_of(ref_id))

    def release(self, handle, transport: str) -> None:
        self._transport(transport).release(handle)

    def receive(self, handle, shape: KVShape, record: RefRecord, transport: str, timeout_s: float = 30.0) -> Received:
        """Pull a peer's exposed KV and keep it as a payload ref (its record and `TransferStats`).
        It enters vLLM's cache when a session continuing it starts. Approximate KV is refused."""
        self.faults.maybe_fail("receive")
        c = self.engine.config
        expected = check_incoming(handle, shape, record, ReceiverGeometry(
            self.name, self.engine.fingerprint, c.num_layers, c.num_kv_heads, c.head_dim, self.engine.dtype,
            c.max_position_embeddings))
        if not record.exact:
            raise VLLMUnsupportedError(f"vLLM replica {self.name} takes exact KV only: vLLM's prefix cache would "
                                       "serve approximate KV as exact; recompute from text instead")
        kv = torch.empty(expected, dtype=self.engine.dtype)
        stats = as_transfer_error(transport, self.name,
                                  lambda: self._transport(transport).fetch(handle, kv, timeout_s=timeout_s))
        return Received(self._record(KVExport(shape.fingerprint, tuple(record.token_ids), kv), record.fidelity), stats)

    def _close_engine(self) -> None:
        """Close the transports and stop vLLM."""
        for t in self._transports.values():
            t.close()
        self._transports.clear()
        self.engine.close()
