"""`VLLMReplica`: a model replica on vLLM with `ModelReplica`'s interface (sessions, refs, transfer).

KV refs are aaflow KV payloads (`KVExport`, [layers, 2, n, kv_heads, head_dim]) held in this
process: `materialize` prefills on vLLM and reads the KV back through the aaflow connector;
`receive` keeps the incoming payload. A payload enters vLLM's cache through the connector when a
session that continues it (`session_open(sid, fork_of=ref)`) sends its first request. Compose
(exact, rerotate) and evict work on the payloads (`cluster.payload_refs`); calibration runs
through sessions' requests (`cluster.vllm_calibration`).

Sessions map to vLLM requests. An incremental prefill is a prefill-only request (max_tokens=1,
token discarded) over the prompt so far, which leaves its full blocks in vLLM's automatic prefix
cache; the final prefill adds the full-prompt request (the cache serves the prefix) and returns
its first token; `session_step` returns one more token per session. vLLM steps every running
request together; the server keeps tokens until they are asked for (`aaflow.engines_vllm.server`).
Counts: "computed" is what vLLM computed for the request (prompt minus cache hits, which can
exceed the new segment: vLLM caches full blocks only), "reused" the segment's tokens it did not.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from aaflow.engine.sampling import SamplingParams
from aaflow.engine.sequence import KVExport
from aaflow.engines_vllm.errors import VLLMUnsupportedError
from aaflow.errors import KVComposeError, KVImportError, KVTransferError, ModelMismatchError
from cluster.faults import FaultInjection
from cluster.payload_refs import PayloadRefs
from cluster.replica import RefRecord
from cluster.replica_api import Replica
from cluster.transfer_endpoint import KVShape, check_descriptor
from cluster.vllm_calibration import VLLMCalibration
from operators.fork import check_fork_count

VLLM_OPTIONS = ("prefix_caching", "max_model_len", "kv_cache_gib", "block_size", "enforce_eager", "python",
                "startup_timeout_s")


@dataclass
class _Session:
    rid: str
    tokens: list[int]
    kv: KVExport | None = None  # payload to load through the connector (fork_of)
    kv_file: Path | None = None
    decoding: bool = False


class VLLMReplica(VLLMCalibration, FaultInjection, Replica):
    """A vLLM engine (child process) and its KV refs, addressed by ref id. One caller at a time."""

    def __init__(self, name: str, model: str, dtype: str = "bfloat16", threads: int | None = None,
                 budget_bytes: int | None = None, **vllm_kwargs) -> None:
        """Start vLLM on `model`. `vllm_kwargs` go to `VLLMEngine.from_pretrained` (see VLLM_OPTIONS);
        `threads` and `budget_bytes` are the built-in replica's and are not used here.

        Raises:
            VLLMUnavailableError: vLLM is missing or failed to start (names the fix).
            TypeError: an option vLLM replicas do not take.
        """
        from aaflow.engines_vllm import VLLMEngine

        unknown = sorted(set(vllm_kwargs) - set(VLLM_OPTIONS))
        if unknown:
            raise TypeError(f"vLLM replicas take {VLLM_OPTIONS}, not {unknown}")
        self.name, self.model = name, model
        self.engine = VLLMEngine.from_pretrained(model, dtype=dtype, **vllm_kwargs)
        self._refs = PayloadRefs(name, self.engine.fingerprint, self.engine.export_kv)
        self._sessions: dict[str, _Session] = {}
        self._transports: dict[str, object] = {}
        self._ids = itertools.count()
        self._computed = self._reused = 0
        self._rotary = None  # made on the first rerotate compose

    # --- identity -------------------------------------------------------------------------
    def info(self) -> dict:
        """Like `ModelReplica.info`, plus "engine": "vllm" and vLLM's own info under "vllm"."""
        c = self.engine.config
        dtype_bytes = torch.empty(0, dtype=self.engine.dtype).element_size()
        vinfo = self.engine.info
        return {"name": self.name, "model": self.model, "engine": "vllm", "fingerprint": self.engine.fingerprint,
                "pid": os.getpid(), "bytes_per_token": c.num_layers * 2 * c.num_kv_heads * c.head_dim * dtype_bytes,
                "dtype": str(self.engine.dtype).removeprefix("torch."), "threads": None,
                "vocab_size": c.vocab_size, "model_path": str(self.engine.model_path),
                "max_tokens": min(c.max_position_embeddings, vinfo.get("max_model_len", c.max_position_embeddings)),
                "vllm": vinfo}

    def stats(self) -> dict:
        """used_blocks: vLLM blocks held by open requests (prefix-cached free blocks are not used)."""
        s = self.engine.server_stats()
        return {"used_blocks": s["used_blocks"], "free_blocks": None, "cached_blocks": None,
                "tokens_computed": self._computed, "tokens_reused": self._reused, "refs": len(self._refs),
                "requests": s["running"]}

    def clear_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def _record(self, payload: KVExport, fidelity=None, lineage: bool = True) -> RefRecord:
        ref_id = f"{self.name}:v{next(self._ids)}"
        self._refs.add(ref_id, payload, fidelity, lineage)
        return self._record_of(ref_id)

    def _record_of(self, ref_id: str) -> RefRecord:
        payload = self._refs.get(ref_id)
        return RefRecord(ref_id, self.name, payload.fingerprint, tuple(payload.token_ids),
                         payload.kv.numel() * payload.kv.element_size(), self._refs.fidelity(ref_id))

    def _ref(self, ref_id: str) -> KVExport:
        return self._refs.get(ref_id)

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
        return [self._record(payload, self._refs.fidelity(ref_id)) for _ in range(n)]

    def compose(self, ref_ids: list[str], mode: str = "exact", r: float = 0.15) -> RefRecord:
        """`exact` and `rerotate` compose of payloads here (the rules of `operators.compose`). `blend`
        recomputes chosen tokens layer by layer inside the engine, which vLLM does not expose: refused."""
        from operators.compose import join_parts
        from operators.ref import FidelityReport

        if mode == "blend":
            raise VLLMUnsupportedError(f"compose mode 'blend' is not supported on vLLM replica {self.name}: use "
                                       "'rerotate' here, or blend on a built-in replica and transfer the result")
        if mode not in ("exact", "rerotate"):
            raise KVComposeError(f"unknown compose mode {mode!r}: use 'exact', 'rerotate' or 'blend'")
        parts = [(i, self._ref(i).token_ids, self._ref(i).kv) for i in ref_ids]
        if self._rotary is None:  # the built-in engine's RoPE: the payload format is the same
            from aaflow.engine.rope import RotaryTable

            self._rotary = RotaryTable(self.engine.config, self.engine.dtype)
        tokens, kv, moved = join_parts(parts, mode, self._rotary.shift_kv)
        fidelity = FidelityReport(mode, total_tokens=len(tokens)) if moved else None
        return self._record(KVExport(self.engine.fingerprint, tuple(tokens), kv), fidelity)

    def pin(self, ref_id: str, ttl_s: float | None = None) -> None:
        """Accepted for any live ref: this replica has no byte budget, so only `evict` drops payloads."""
        self._refs.require(ref_id)

    unpin = pin

    def evict(self, ref_id: str, spill: bool | None = None) -> None:
        """Drop the payload (to disk if `spill`); the next use reloads it or recomputes it on vLLM."""
        self._refs.evict(ref_id, bool(spill))

    def free(self, ref_id: str) -> None:
        self._refs.free(ref_id)

    def export_tensor(self, ref_id: str) -> torch.Tensor:
        return self._ref(ref_id).kv

    # --- transfer -----------------------------------------------------------------------------
    def _transport(self, name: str):
        if name.split("@")[0] != "ray":
            raise VLLMUnsupportedError(f"vLLM replica {self.name} moves KV over the 'ray' transport only, "
                                       f"not {name!r}: pass transport='ray'")
        if name not in self._transports:
            from cluster.transports import get_transport

            self._transports[name] = get_transport(name)
        return self._transports[name]

    def expose(self, ref_id: str, transport: str) -> tuple[object, KVShape, RefRecord]:
        """Make the ref's payload readable by a peer; returns (handle, shape to check, record)."""
        payload = self._ref(ref_id)
        handle = self._transport(transport).expose(payload.kv.contiguous())
        shape = KVShape(payload.fingerprint, tuple(payload.kv.shape), str(payload.kv.dtype).removeprefix("torch."))
        return handle, shape, self._record_of(ref_id)

    def release(self, handle, transport: str) -> None:
        self._transport(transport).release(handle)

    def receive(self, handle, shape: KVShape, record: RefRecord, transport: str, timeout_s: float = 30.0):
        """Pull a peer's exposed KV and keep it as a payload ref; returns (record, TransferStats).
        It enters vLLM's cache when a session continuing it starts. Approximate KV is refused."""
        self._maybe_fail("receive")
        check_descriptor(handle, shape, record)
        if shape.fingerprint != self.engine.fingerprint:
            raise ModelMismatchError(f"replica {self.name} serves model {self.engine.fingerprint[:12]}..., the KV is "
                                     f"of model {shape.fingerprint[:12]}...; recompute from text instead")
        if not record.exact:
            raise VLLMUnsupportedError(f"vLLM replica {self.name} takes exact KV only: vLLM's prefix cache would "
                                       "serve approximate KV as exact; recompute from text instead")
        c = self.engine.config
        expected = (c.num_layers, 2, len(record.token_ids), c.num_kv_heads, c.head_dim)
        dtype = getattr(torch, shape.dtype, None)
        if tuple(shape.shape) != expected or dtype != self.engine.dtype:
            raise KVImportError(f"incoming KV {shape.shape} {shape.dtype} does not match vLLM replica {self.name}'s "
                                f"{expected} {str(self.engine.dtype).removeprefix('torch.')}")
        declared = torch.Size(expected).numel() * dtype.itemsize
        if record.nbytes != declared or handle.nbytes != declared or len(record.token_ids) > c.max_position_embeddings:
            raise KVImportError(f"incoming KV of {len(record.token_ids)} tokens ({declared} bytes here) does not match "
                                f"the ref's declared {record.nbytes} bytes, the handle's {handle.nbytes}, or the "
                                f"model's {c.max_position_embeddings} positions: a damaged or forged descriptor")
        kv = torch.empty(expected, dtype=dtype)
        try:
            stats = self._transport(transport).fetch(handle, kv, timeout_s=timeout_s)
        except (KVTransferError, VLLMUnsupportedError):
            raise
        except Exception as exc:  # noqa: BLE001 - any transport failure becomes one typed error
            raise KVTransferError(f"{transport} transfer to {self.name} failed: {exc}") from exc
        return self._record(KVExport(shape.fingerprint, tuple(record.token_ids), kv), record.fidelity), stats

    # --- sessions (driven by the executor) ----------------------------------------------------
    def session_open(self, sid: str, fork_of: str | None = None) -> int:
        """Start a session, empty or continuing a ref (its KV is loaded at the first request); returns its length."""
        payload = self._ref(fork_of) if fork_of else None
        tokens = list(payload.token_ids) if payload is not None else []
        self._sessions[sid] = _Session(f"{self.name}/{sid}/{next(self._ids)}", tokens, payload)
        return len(tokens)

    def _kv_file(self, s: _Session) -> Path | None:
        if s.kv is not None and s.kv_file is None:
            s.kv_file = self.engine.stage_kv(s.kv, s.tokens)
        return s.kv_file

    def session_prefill(self, sid: str, token_ids: list[int], sampling: SamplingParams | None = None,
                        reuse_prefix: bool = True, chunk_size: int | None = None) -> dict:
        """Append prompt tokens; with `sampling` (the last segment) start generating and return the
        first token as "token". Without prefix reuse, partial segments are only recorded (the final
        request computes the whole prompt, reading nothing from vLLM's prefix cache)."""
        s = self._sessions[sid]
        if s.decoding:
            raise VLLMUnsupportedError(f"session {sid} on {self.name} is generating; it cannot take more prompt")
        t0 = time.perf_counter()
        s.tokens.extend(int(t) for t in token_ids)
        if sampling is None and not reuse_prefix:
            return {"computed": 0, "reused": 0, "seconds": time.perf_counter() - t0}
        kv_file = self._kv_file(s)
        use_cache = reuse_prefix or s.kv is not None
        if sampling is None:  # prefill-only request: its full blocks stay in vLLM's prefix cache
            rid = f"{s.rid}/prefill{next(self._ids)}"
            self.engine.start_request(rid, s.tokens, SamplingParams(max_new_tokens=1, ignore_eos=True), kv_file)
            try:
                first = self.engine.next_tokens([rid])[0]
            finally:
                self.engine.abort_requests([rid])
        else:
            self.engine.start_request(s.rid, s.tokens, sampling, kv_file, use_prefix_cache=use_cache)
            s.decoding = True
            first = self.engine.next_tokens([s.rid])[0]
        computed = len(s.tokens) - int(first["num_cached_tokens"])
        out = {"computed": computed, "reused": max(0, len(token_ids) - computed), "seconds": time.perf_counter() - t0}
        self._computed += computed
        self._reused += out["reused"]
        if sampling is not None:
            out["token"] = int(first["token"])
        return out

    def session_prefill_many(self, requests: list[tuple]) -> list[dict]:
        """`session_prefill` for each (sid, token_ids, sampling, reuse_prefix), one after another."""
        return [self.session_prefill(sid, ids, sampling, reuse) for sid, ids, sampling, reuse in requests]

    def session_step(self, sids: list[str]) -> list[int]:
        """One new token per session (vLLM advances all its running requests together)."""
        self._maybe_fail("step")
        sessions = [self._sessions[sid] for sid in sids]
        if not all(s.decoding for s in sessions):
            raise VLLMUnsupportedError(f"sessions {sids} on {self.name}: step before the final prefill")
        return [int(o["token"]) for o in self.engine.next_tokens([s.rid for s in sessions])]

    def session_step_mixed(self, sids: list[str], requests: list[tuple]) -> tuple[list[int], list[dict]]:
        """`session_step`, then `session_prefill_many` (vLLM schedules its own batches)."""
        return self.session_step(sids), self.session_prefill_many(requests)

    def session_close(self, sid: str) -> None:
        """End a session: its vLLM request is aborted (blocks go back, full ones stay cached)."""
        s = self._sessions.pop(sid, None)
        if s is not None:
            if s.decoding:
                self.engine.abort_requests([s.rid])
            self.engine.unstage_kv(s.kv_file)

    def session_count(self) -> int:
        return len(self._sessions)

    def close(self) -> None:
        """Close every session and stop vLLM."""
        for sid in list(self._sessions):
            try:
                self.session_close(sid)
            except Exception:  # noqa: BLE001 - vLLM may already be gone; it is stopped below
                pass
        self._refs.clear()
        for t in self._transports.values():
            t.close()
        self._transports.clear()
        self.engine.close()

