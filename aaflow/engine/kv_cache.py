"""The paged KV cache: one preallocated tensor whose layout is written down once, here."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Layout of the pool tensor: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim].

    A *slot* is one token position in the pool: slot = block_id * block_size + offset.
    A block's K (or V) of one layer is contiguous: [block_size, num_kv_heads, head_dim].
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_nbytes(self) -> int:
        """Bytes of K and V of one token across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers (K and V)."""
        return self.token_nbytes * self.block_size


_MIN_RUN = 64  # below this mean run length (tokens), one gather / scatter beats many small copies


def _long_runs(slots: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """`slot_runs(slots)` when they are long enough to copy run by run; None for a fragmented table."""
    runs = slot_runs(slots)
    return runs if len(runs) * _MIN_RUN <= len(slots) else None


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """slots: [T] -> (offset in slots, first slot, length) of each run of consecutive slots."""
    if len(slots) == 0:
        return []
    breaks = torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1  # [runs - 1]
    starts = [0] + breaks.tolist()
    ends = starts[1:] + [len(slots)]
    firsts = slots[starts].tolist()
    return [(a, f, b - a) for a, b, f in zip(starts, ends, firsts)]


class PagedKVCache:
    """Owns the pool tensor; reads and writes K/V by slot. Knows nothing of sequences."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.tensor = torch.zeros(layout.shape, dtype=layout.dtype)  # zeros: padded reads stay finite
        slots = layout.num_blocks * layout.block_size
        self._flat = self.tensor.view(layout.num_layers, 2, slots, layout.num_kv_heads, layout.head_dim)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [num_slots, num_kv_heads, head_dim] views."""
        return self._flat[index, 0], self._flat[index, 1]

    def write(self, index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T]; k, v: [T, num_kv_heads, head_dim] -> stored at those slots of layer `index`."""
        k_cache, v_cache = self.layer(index)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block (every layer, K and V) onto another: copy-on-write."""
        self.tensor[:, :, dst].copy_(self.tensor[:, :, src])

    def read_tokens(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """slots: [T] -> contiguous KV [num_layers, 2, T, num_kv_heads, head_dim] (into `out` if given).

        Copies whole runs of consecutive slots (a sequence's blocks, merged where their ids follow
        each other) instead of gathering token by token: a few large copies run near memcpy speed."""
        lay = self.layout
        if out is None:
            out = torch.empty((lay.num_layers, 2, len(slots), lay.num_kv_heads, lay.head_dim), dtype=lay.dtype)
        runs = _long_runs(slots)
        if runs is None:  # fragmented: one gather beats many small copies
            return torch.index_select(self._flat, 2, slots, out=out)
        for dst, src, n in runs:
            out[:, :, dst:dst + n].copy_(self._flat[:, :, src:src + n])
        return out

    def byte_segments(self, slots: torch.Tensor) -> list[tuple[int, int]]:
        """slots: [T] -> (address, nbytes) of the pool memory holding their KV, in the order of
        `read_tokens`' output ([num_layers, 2, T, ...]): what a scatter-gather transport reads or
        writes in place, instead of a contiguous copy. One segment per run of slots per layer and K/V."""
        lay = self.layout
        row = lay.num_kv_heads * lay.head_dim * lay.dtype_bytes  # one token's K (or V) in one layer
        plane = lay.num_blocks * lay.block_size * row  # one layer's K (or V) for every slot
        base = self.tensor.data_ptr()
        runs = slot_runs(slots)
        return [(base + p * plane + first * row, n * row) for p in range(lay.num_layers * 2) for _, first, n in runs]

    def write_tokens(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """slots: [T]; kv: [num_layers, 2, T, num_kv_heads, head_dim] -> stored at those slots (by runs,
        as `read_tokens`)."""
        runs = _long_runs(slots)
        if runs is None:
            self._flat.index_copy_(2, slots, kv)
            return
        for dst, src, n in runs:
            self._flat[:, :, src:src + n].copy_(kv[:, :, dst:dst + n])

