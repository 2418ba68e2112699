"""Moving a sequence's KV out of and into the pool: contiguous export/import, and reserve-then-seal
for transports that write straight into pool memory. A mixin of `KVRunner` (uses its sequences,
blocks, cache and layout)."""

from __future__ import annotations

import numbers

import torch

from aaflow.engine.sequence import KVExport, Sequence
from aaflow.common.errors import KVImportError


class KVImportExport:
    """Export, import and in-place import of sequences' KV (mixed into `KVRunner`)."""

    def export_kv(self, seq_id: int, out: torch.Tensor | None = None) -> KVExport:
        """The sequence's KV as one contiguous [layers, 2, n, kv_heads, head_dim] tensor (a copy,
        written into `out` when given: a reusable, transport-registered staging buffer)."""
        kv = self.cache.read_tokens(self.kv_slots(seq_id), out)
        return KVExport(self.fingerprint, tuple(self.get(seq_id).token_ids), kv)

    def import_kv(self, export: KVExport, cacheable: bool = True) -> int:
        """A new sequence holding imported KV; checked against this engine before any memory is touched.

        `cacheable=False` marks approximate KV, which must never serve prefix-cache hits.
        """
        if not all(hasattr(export, a) for a in ("fingerprint", "token_ids", "kv")):
            raise KVImportError(f"import_kv takes a KVExport (from export_kv) or a KVPayload, with fingerprint, "
                                f"token_ids and kv; got {type(export).__name__}")
        self._check_model(export.fingerprint)
        self._check_token_ids(export.token_ids)
        if not isinstance(export.kv, torch.Tensor):
            raise KVImportError(f"imported KV must be a torch.Tensor, got {type(export.kv).__name__}")
        lay = self.layout
        expected = (lay.num_layers, 2, len(export.token_ids), lay.num_kv_heads, lay.head_dim)
        if tuple(export.kv.shape) != expected:
            raise KVImportError(f"KV shape {tuple(export.kv.shape)} does not match this engine's {expected}")
        if export.kv.dtype != lay.dtype:
            raise KVImportError(f"KV dtype {export.kv.dtype} does not match this engine's {lay.dtype}")
        seq_id = self.reserve_kv(export.fingerprint, export.token_ids, cacheable)
        self.cache.write_tokens(self.kv_slots(seq_id), export.kv)
        self.seal_kv(seq_id)
        return seq_id

    def reserve_kv(self, fingerprint: str, token_ids: list[int] | tuple[int, ...], cacheable: bool = True) -> int:
        """A new sequence with blocks for `token_ids` whose KV is not written yet (checked first).

        The caller writes its KV (`kv_slots`; a transport reading straight into the pool), then
        calls `seal_kv`, or frees it. Until sealed, none of its blocks can serve a prefix-cache hit.
        """
        self._check_model(fingerprint)
        if not token_ids:
            raise KVImportError("cannot import an empty KV export")
        self._check_token_ids(token_ids)
        seq = Sequence(next(self._ids), cacheable=cacheable)
        self._check_positions(seq, len(token_ids))
        self.blocks.check_capacity(self.blocks.blocks_needed(0, len(token_ids)))
        self._grow(seq, len(token_ids))
        seq.token_ids = list(token_ids)
        self.sequences[seq.seq_id] = seq
        return seq.seq_id

    def check_room(self, num_tokens: int) -> None:
        """Raise before anything is allocated if `num_tokens` of imported KV cannot fit: beyond the
        model's positions (`KVImportError`) or the pool's free blocks (`KVCapacityError`)."""
        limit = self.model.config.max_position_embeddings
        if num_tokens > limit:
            raise KVImportError(f"incoming KV of {num_tokens} tokens is beyond the model's {limit} positions; "
                                "the descriptor is damaged or forged")
        self.blocks.check_capacity(self.blocks.blocks_needed(0, num_tokens))

    def _check_token_ids(self, token_ids) -> None:
        vocab = self.model.config.vocab_size
        if not isinstance(token_ids, (list, tuple)):
            raise KVImportError(f"imported KV's token ids must be a list of ints, got {type(token_ids).__name__}")
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
        if bad:
            raise KVImportError(f"imported KV's token ids {bad[:5]!r} are not ids of this model's vocabulary "
                                f"[0, {vocab}); the payload is damaged or of another model: recompute from text")

    def _check_model(self, fingerprint: str) -> None:
        if fingerprint != self.fingerprint:
            raise KVImportError(
                f"KV was computed by model {str(fingerprint)[:16]}..., this engine is "
                f"{self.fingerprint[:16]}...; recompute from text on this engine instead"
            )

    def kv_slots(self, seq_id: int) -> torch.Tensor:
        """[len(seq)] pool slots of the sequence's tokens, in order."""
        seq = self.get(seq_id)
        return seq.slots(0, len(seq), self.layout.block_size)

    def seal_kv(self, seq_id: int) -> None:
        """Offer the full blocks of a sequence whose KV was written by `reserve_kv`'s caller to the
        prefix cache (a no-op for approximate KV)."""
        self._seal_full_blocks(self.get(seq_id))
