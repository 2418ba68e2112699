"""The one interface of the engine's attention paths.

A forward pass attends through the batch object `AttentionPaths` (attention_paths.py) builds for it,
the one place a path is chosen: paged (`AttentionBatch`, `PackedBatch`), cascade over a shared prefix
(`CascadeBatch`, `GroupedCascadeBatch`), the compiled decode kernel (`KernelDecodeBatch`), runs of
blocks read in place or gathered contexts (`RunsDecodeBatch`, `GatheredDecodeBatch`), tiled prefill
(`TiledPrefillBatch`) and the deterministic fixed tiles (`FixedBatch`). Each implements `attend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from aaflow.engine.kv_cache import PagedKVCache


class AttentionPass(Protocol):
    """A pass's attention over the paged KV cache, for every layer of the model."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache) -> torch.Tensor:
        """q [T, H, D]: the pass's queries; k, v [T, Hkv, D]: its new keys (already rotated) and values,
        which the path writes into `cache` at the pass's slots for `layer` -> [T, H * D]."""
        ...
