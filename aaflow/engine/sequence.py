"""Per-sequence state: the tokens whose KV is in the pool and the blocks that hold it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aaflow.engine.block_manager import NO_HASH


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is stored (positions 0..n-1)
    block_table: list[int] = field(default_factory=list)  # block i holds positions [i*bs, (i+1)*bs)
    num_sealed: int = 0  # leading full blocks registered in the prefix cache
    last_hash: int = NO_HASH  # chain hash of the last sealed block
    cacheable: bool = True  # False for approximate KV (re-rotated / blended): never enters the prefix cache

    def __len__(self) -> int:
        return len(self.token_ids)

    def slots(self, start: int, stop: int, block_size: int) -> torch.Tensor:
        """Pool slots of positions [start, stop): [stop - start] int64."""
        pos = torch.arange(start, stop)
        table = torch.tensor(self.block_table, dtype=torch.long)
        return table[pos // block_size] * block_size + pos % block_size


def padded_slots(seqs: list[Sequence], lengths: list[int], block_size: int) -> torch.Tensor:
    """Pool slots of positions [0, lengths[b]) of each sequence in one padded row (slot 0 past a
    row's length): [B, max(lengths)] int64, built at once (one `slots` call per sequence slowed
    decode steps of many sequences: docs/RESULTS-history.md)."""
    width = max(lengths)
    blocks = -(-width // block_size)
    table = torch.tensor([s.block_table[:blocks] + [0] * (blocks - len(s.block_table[:blocks])) for s in seqs],
                         dtype=torch.long)  # [B, blocks]
    pos = torch.arange(width)
    slots = table[:, pos // block_size] * block_size + pos % block_size  # [B, width]
    return slots.masked_fill_(pos >= torch.tensor(lengths)[:, None], 0)


@dataclass(frozen=True)
class KVExport:
    """A sequence's KV as one contiguous tensor, ready for a transport or a file.

    Attributes:
        fingerprint: the model fingerprint of the engine that computed it.
        token_ids: the tokens at positions 0..n-1.
        kv: [num_layers, 2 (k, v), n, num_kv_heads, head_dim] in the engine's dtype.
    """

    fingerprint: str
    token_ids: tuple[int, ...]
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
