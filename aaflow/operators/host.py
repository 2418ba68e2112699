"""`KVHost`: the directory of KVRefs on one engine, with the eviction policy and the disk tier.

Every operator goes through a host to reach an engine's sequences. A ref's KV may be resident
(a sequence in the pool), evicted (rebuilt from lineage or reloaded from disk on next use), or
freed (any use raises `KVRefFreedError`).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from aaflow.common.errors import InvalidArgumentError, KVEvictedError, KVRefFreedError
from aaflow.operators.ref import FidelityReport, KVRef, Lineage, new_ref_id
from aaflow.operators.spec import KVSpec
from aaflow.operators.spill import load_spilled, spill_export

_host_names = itertools.count(1)


@dataclass(frozen=True)
class EvictionPolicy:
    """When the host evicts on its own.

    Attributes:
        budget_bytes: keep the pool's used bytes at or under this (None: no budget). Least recently
            used unpinned refs are evicted first.
        spill: write evicted KV to the disk tier (safetensors) instead of dropping it.
    """

    budget_bytes: int | None = None
    spill: bool = False

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {self.budget_bytes}")


@dataclass
class _Entry:
    ref: KVRef
    seq_id: int | None  # None while evicted
    last_used: float = field(default_factory=time.monotonic)
    pinned_until: float | None = None  # monotonic deadline; inf = pinned until unpinned
    spill_path: Path | None = None
    freed: bool = False

    def pinned(self, now: float) -> bool:
        return self.pinned_until is not None and now < self.pinned_until


class KVHost:
    """The KVRefs living on one engine. Not thread-safe: one caller at a time."""

    def __init__(self, engine, name: str | None = None, policy: EvictionPolicy | None = None,
                 spill_dir: str | Path | None = None) -> None:
        self.engine = engine
        self.name = name or f"engine-{next(_host_names)}"
        self.policy = policy or EvictionPolicy()
        self.spec = KVSpec.of(engine)
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self._entries: dict[str, _Entry] = {}

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint

    # --- registration and lookup ----------------------------------------------------------
    def register(self, seq_id: int, lineage: Lineage | None, fidelity: FidelityReport | None = None) -> KVRef:
        """Make a ref for a sequence this host now owns, then apply the budget."""
        ref = KVRef(new_ref_id(), self.fingerprint, tuple(self.engine.sequence_tokens(seq_id)), self,
                    tuple(self.engine.block_table(seq_id)), self.spec, lineage, fidelity)
        self._entries[ref.id] = _Entry(ref, seq_id)
        self.enforce_budget(keep=(ref.id,))
        return ref

    def _entry(self, ref: KVRef) -> _Entry:
        entry = self._entries.get(ref.id)
        if entry is None or entry.freed:
            raise KVRefFreedError(f"KVRef {ref.id} was freed on {self.name}; materialize the context again")
        return entry

    def sequence(self, ref: KVRef) -> int:
        """The resident sequence of `ref`, reloading or rebuilding it first if it was evicted."""
        entry = self._entry(ref)
        entry.last_used = time.monotonic()
        if entry.seq_id is None:
            entry.seq_id = self._restore(entry)
            self.enforce_budget(keep=(ref.id,))
        return entry.seq_id

    def is_resident(self, ref: KVRef) -> bool:
        return self._entry(ref).seq_id is not None

    def _restore(self, entry: _Entry) -> int:
        if entry.spill_path is not None:
            seq_id = self.engine.import_kv(load_spilled(entry.spill_path, self.fingerprint), cacheable=entry.ref.exact)
            entry.spill_path.unlink(missing_ok=True)
            entry.spill_path = None
            return seq_id
        if entry.ref.lineage is None:
            raise KVEvictedError(
                f"KVRef {entry.ref.id} was evicted and was made with lineage disabled, so it cannot be "
                "rebuilt; materialize it again (or pin it / spill it to disk next time)"
            )
        seq_id = self.engine.new_sequence()
        try:
            self.engine.prefill(seq_id, list(entry.ref.token_ids))
        except Exception:
            self.engine.free(seq_id)
            raise
        return seq_id

    # --- eviction, pinning, freeing -------------------------------------------------------
    def evict(self, ref: KVRef, spill: bool | None = None) -> None:
        """Drop the ref's KV from the pool (spilling it to disk if asked); the ref stays usable."""
        entry = self._entry(ref)
        if entry.seq_id is None:
            return
        if spill if spill is not None else self.policy.spill:
            if self.spill_dir is None:
                raise InvalidArgumentError(f"host {self.name} has no spill_dir, so it cannot spill; create it with "
                                           "KVHost(..., spill_dir=...) or evict without spill")
            entry.spill_path = spill_export(self.engine.export_kv(entry.seq_id), self.spill_dir / f"{ref.id}.safetensors")
        self.engine.free(entry.seq_id)
        entry.seq_id = None

    def free(self, ref: KVRef) -> None:
        """End the ref: its blocks are released and any later use raises `KVRefFreedError`."""
        entry = self._entry(ref)
        if entry.seq_id is not None:
            self.engine.free(entry.seq_id)
        if entry.spill_path is not None:
            entry.spill_path.unlink(missing_ok=True)
        entry.freed, entry.seq_id = True, None
        del self._entries[ref.id]

    def pin(self, ref: KVRef, ttl_s: float | None = None) -> None:
        """Protect a ref from budget eviction, for `ttl_s` seconds (an agent paused for a tool) or until unpinned."""
        if ttl_s is not None and not (isinstance(ttl_s, (int, float)) and not isinstance(ttl_s, bool)
                                      and math.isfinite(ttl_s) and ttl_s >= 0):
            raise InvalidArgumentError(f"pin's ttl_s must be a finite number of seconds >= 0 or None, got {ttl_s!r}")
        self._entry(ref).pinned_until = time.monotonic() + ttl_s if ttl_s is not None else float("inf")

    def unpin(self, ref: KVRef) -> None:
        self._entry(ref).pinned_until = None

    def release_expired(self) -> list[str]:
        """Evict every ref whose pin's TTL has run out (its blocks go to the prefix cache, where the
        pool may reuse or drop them; the ref rebuilds on next use); returns their ids."""
        now = time.monotonic()
        expired = [e for e in self._entries.values()
                   if e.pinned_until is not None and e.pinned_until != float("inf") and now >= e.pinned_until]
        for entry in expired:
            entry.pinned_until = None
            self.evict(entry.ref)
        return [e.ref.id for e in expired]

    def pinned_bytes(self) -> int:
        """KV bytes of resident refs pinned now."""
        now = time.monotonic()
        return sum(e.ref.nbytes for e in self._entries.values() if e.seq_id is not None and e.pinned(now))

    def evictable_bytes(self) -> int:
        """KV bytes of resident refs not pinned (budget eviction may drop them)."""
        now = time.monotonic()
        return sum(e.ref.nbytes for e in self._entries.values() if e.seq_id is not None and not e.pinned(now))

    def used_bytes(self) -> int:
        return self.engine.stats().used * self.spec.bytes_per_block

    def enforce_budget(self, keep: tuple[str, ...] = ()) -> list[str]:
        """Evict least recently used, unpinned refs until the pool is within budget; returns evicted ids."""
        budget = self.policy.budget_bytes
        evicted: list[str] = []
        if budget is None:
            return evicted
        now = time.monotonic()
        candidates = sorted((e for e in self._entries.values()
                             if e.seq_id is not None and e.ref.id not in keep and not e.pinned(now)),
                            key=lambda e: e.last_used)
        for entry in candidates:
            if self.used_bytes() <= budget:
                break
            self.evict(entry.ref)
            evicted.append(entry.ref.id)
        return evicted

    def refs(self) -> list[KVRef]:
        return [e.ref for e in self._entries.values()]

    def close(self) -> None:
        """Free every ref of this host."""
        for entry in list(self._entries.values()):
            self.free(entry.ref)
