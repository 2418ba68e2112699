"""A vLLM replica's sessions: each maps to vLLM requests over the prompt so far.

An incremental prefill is a prefill-only request (max_tokens=1, token discarded) over the prompt
so far, which leaves its full blocks in vLLM's automatic prefix cache; the final prefill adds the
full-prompt request (the cache serves the prefix) and returns its first token; `session_step`
returns one more token per session. vLLM steps every running request together; the server keeps
tokens until they are asked for (`aaflow.engines_vllm.server`). Counts: "computed" is what vLLM
computed for the request (prompt minus cache hits, which can exceed the new segment: vLLM caches
full blocks only), "reused" the segment's tokens it did not.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

from aaflow.engine.sampling import SamplingParams
from aaflow.engine.sequence import KVExport
from aaflow.engines_vllm.errors import VLLMUnsupportedError
from aaflow.cluster.sessions import SessionTable
from aaflow.runtime.replies import MixedReply, PrefillReply


@dataclass
class _Session:
    rid: str
    tokens: list[int]
    kv: KVExport | None = None  # payload to load through the connector (fork_of)
    kv_file: Path | None = None
    decoding: bool = False


class VLLMSessions:
    """Sessions of the vLLM replica `name`, addressed by a string id."""

    def __init__(self, name: str, engine, refs, faults) -> None:
        """`refs`: the replica's `PayloadRefs` (a session may continue a ref); `faults`: its
        `FaultInjection` (a decode step may fail on purpose)."""
        self.name, self.engine, self.refs, self.faults = name, engine, refs, faults
        self.table: SessionTable = SessionTable()
        self.computed = self.reused = 0  # tokens vLLM computed / did not, over every prefill
        self._ids = itertools.count()

    def session_open(self, sid: str, fork_of: str | None = None) -> int:
        """Start a session, empty or continuing a ref (its KV is loaded at the first request); returns its length."""
        payload = self.refs.get(fork_of) if fork_of else None
        tokens = list(payload.token_ids) if payload is not None else []
        self.table[sid] = _Session(f"{self.name}/{sid}/{next(self._ids)}", tokens, payload)
        return len(tokens)

    def _kv_file(self, s: _Session) -> Path | None:
        if s.kv is not None and s.kv_file is None:
            s.kv_file = self.engine.stage_kv(s.kv, s.tokens)
        return s.kv_file

    def session_prefill(self, sid: str, token_ids: list[int], sampling: SamplingParams | None = None,
                        reuse_prefix: bool = True, chunk_size: int | None = None) -> PrefillReply:
        """Append prompt tokens; with `sampling` (the last segment) start generating and return the
        first token as `token`. Without prefix reuse, partial segments are only recorded (the final
        request computes the whole prompt, reading nothing from vLLM's prefix cache)."""
        s = self.table[sid]
        if s.decoding:
            raise VLLMUnsupportedError(f"session {sid} on {self.name} is generating; it cannot take more prompt")
        t0 = time.perf_counter()
        s.tokens.extend(int(t) for t in token_ids)
        if sampling is None and not reuse_prefix:
            return PrefillReply(0, 0, time.perf_counter() - t0)
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
        reused = max(0, len(token_ids) - computed)
        self.computed += computed
        self.reused += reused
        return PrefillReply(computed, reused, time.perf_counter() - t0,
                            int(first["token"]) if sampling is not None else None)

    def session_prefill_many(self, requests: list[tuple]) -> list[PrefillReply]:
        """`session_prefill` for each (sid, token_ids, sampling, reuse_prefix), one after another."""
        return [self.session_prefill(sid, ids, sampling, reuse) for sid, ids, sampling, reuse in requests]

    def session_step(self, sids: list[str]) -> list[int]:
        """One new token per session (vLLM advances all its running requests together)."""
        self.faults.maybe_fail("step")
        sessions = [self.table[sid] for sid in sids]
        if not all(s.decoding for s in sessions):
            raise VLLMUnsupportedError(f"sessions {sids} on {self.name}: step before the final prefill")
        return [int(o["token"]) for o in self.engine.next_tokens([s.rid for s in sessions])]

    def session_step_mixed(self, sids: list[str], requests: list[tuple]) -> MixedReply:
        """`session_step`, then `session_prefill_many` (vLLM schedules its own batches)."""
        return MixedReply(self.session_step(sids), self.session_prefill_many(requests))

    def session_close(self, sid: str) -> None:
        """End a session: its vLLM request is aborted (blocks go back, full ones stay cached)."""
        s = self.table.pop(sid, None)
        if s is not None:
            if s.decoding:
                self.engine.abort_requests([s.rid])
            self.engine.unstage_kv(s.kv_file)

    def session_count(self) -> int:
        return len(self.table)

    def close_all(self) -> None:
        """Close every session (vLLM may already be gone: a failure to abort is ignored)."""
        for sid in list(self.table):
            try:
                self.session_close(sid)
            except Exception:  # noqa: BLE001 - vLLM may already be gone; it is stopped after this
                pass
