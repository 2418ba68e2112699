"""KV refs held as payloads in a replica process (the vLLM replica's KV objects).

A payload is a `KVExport` ([layers, 2, n, kv_heads, head_dim] plus token ids and fingerprint).
`evict` drops it, or writes it to a safetensors file (the disk tier); the next use reloads the file
(checked against the fingerprint first) or rebuilds the KV from the ref's token ids, like the
built-in replica's `KVHost`. A ref made with lineage disabled cannot be rebuilt and says so.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from aaflow.engine.sequence import KVExport
from aaflow.common.errors import KVEvictedError, KVRefFreedError
from aaflow.operators.ref import FidelityReport
from aaflow.operators.spill import load_spilled, spill_export


@dataclass
class _Entry:
    token_ids: tuple[int, ...]
    fidelity: FidelityReport | None
    lineage: bool
    payload: KVExport | None  # None: evicted
    spill_path: Path | None = None


class PayloadRefs:
    """Payload refs by id, with eviction, spill and rebuild (`rebuild(token_ids) -> KVExport`)."""

    def __init__(self, owner: str, fingerprint: str, rebuild: Callable[[list[int]], KVExport]) -> None:
        self.owner, self.fingerprint, self._rebuild = owner, fingerprint, rebuild
        self._entries: dict[str, _Entry] = {}
        self._spill_dir: Path | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, ref_id: str, payload: KVExport, fidelity: FidelityReport | None = None,
            lineage: bool = True) -> None:
        self._entries[ref_id] = _Entry(tuple(payload.token_ids), fidelity, lineage, payload)

    def require(self, ref_id: str) -> None:
        """Raise `KVRefFreedError` unless `ref_id` is a live ref (resident or evicted)."""
        self._entry(ref_id)

    def fidelity(self, ref_id: str) -> FidelityReport | None:
        return self._entry(ref_id).fidelity

    def get(self, ref_id: str) -> KVExport:
        """The payload, reloaded from disk or rebuilt from the token ids first if it was evicted."""
        entry = self._entry(ref_id)
        if entry.payload is None:
            entry.payload = self._restore(ref_id, entry)
        return entry.payload

    def is_resident(self, ref_id: str) -> bool:
        return self._entry(ref_id).payload is not None

    def evict(self, ref_id: str, spill: bool = False) -> None:
        """Drop the payload (to a safetensors file if `spill`); the ref stays usable."""
        entry = self._entry(ref_id)
        if entry.payload is None:
            return
        if spill:
            if self._spill_dir is None:
                self._spill_dir = Path(tempfile.mkdtemp(prefix="aaflow-spill-"))
            entry.spill_path = spill_export(entry.payload, self._spill_dir / f"{ref_id.replace('/', '_')}.safetensors")
        entry.payload = None

    def free(self, ref_id: str) -> None:
        entry = self._entries.pop(ref_id, None)
        if entry is None:
            self._entry(ref_id)  # raises
        if entry.spill_path is not None:
            entry.spill_path.unlink(missing_ok=True)

    def clear(self) -> None:
        self._entries.clear()
        if self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir = None

    def _entry(self, ref_id: str) -> _Entry:
        if ref_id not in self._entries:
            raise KVRefFreedError(f"no KVRef {ref_id} on replica {self.owner}: it was freed or never lived here")
        return self._entries[ref_id]

    def _restore(self, ref_id: str, entry: _Entry) -> KVExport:
        if entry.spill_path is not None:
            loaded = load_spilled(entry.spill_path, self.fingerprint)
            entry.spill_path.unlink(missing_ok=True)
            entry.spill_path = None
            return KVExport(loaded.fingerprint, loaded.token_ids, loaded.kv)
        if not entry.lineage:
            raise KVEvictedError(f"KVRef {ref_id} was evicted and was made with lineage disabled, so it cannot "
                                 "be rebuilt; materialize it again (or spill it to disk next time)")
        return self._rebuild(list(entry.token_ids))
