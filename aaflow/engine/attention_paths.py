"""Which attention path a forward pass takes: the `AttentionPass` (attention_pass.py) it attends through,
chosen from the engine's dtype, the CPU and the sequences' block tables.

Prefill: deterministic mode's fixed tiles; else each chunk over its context, in bf16 as tiles of
plain products (with AMX through the flash kernel, which beats tiles there), in fp32 through the
flash kernel, a prefix every chunk shares attended once (in tiles: the chunks continuing each
cached prefix attended together, `prefix_groups.py`), short chunks in the decode kernel
(`tiled_attention.py`). fp32 where the decode kernel cannot serve the head dim keeps the masked
per-sequence path (`prefill_parts`, cascade), which batches same-length chunks; tests compare
against it. Decode: deterministic mode's fixed tiles; in bf16 the
compiled kernel, unless a large batch shares a long prefix (cascade on AMX); else runs of blocks read
in place, gathered contexts, or a shared prefix in cascade. fp32 decode: several prefixes each shared
by a group of the batch, each attended once for its group (`grouped_cascade.py`), or one prefix the
whole batch shares (cascade), then every sequence's remainder in the compiled kernel (torch's paths
where it cannot be built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.engine.attention import AttentionBatch, prefill_parts
from aaflow.engine.cascade import (CASCADE_DECODE_MIN_BATCH, CASCADE_DECODE_MIN_SHARED_READS, CascadeBatch,
                                   decode_in_cascade, leading_run_blocks, shared_prefix_blocks)
from aaflow.engine.decode_kernel import KernelDecodeBatch, KernelReads, supports as decode_kernel_supports
from aaflow.engine import grouped_cascade
from aaflow.engine.fixed_attention import FixedBatch
from aaflow.engine.grouped_cascade import prefix_groups
from aaflow.engine.run_attention import GatheredDecodeBatch, RunsDecodeBatch, reads_in_place_pays
from aaflow.engine.sequence import Sequence
from aaflow.engine.tiled_attention import TiledPrefillBatch, prefill_kernel
from aaflow.common.machine import matrix_isa


@dataclass
class AttentionPaths:
    """The paths an engine may take (tests switch them to compare paths on one engine). Deterministic
    mode is the model's flag, read on every pass (`aaflow bench engine` switches it on one engine)."""

    block_size: int
    tiled_prefill: bool  # prefill chunk by chunk over each context (`TiledPrefillBatch`), short ones in the kernel
    flash_prefill: bool  # ... through the flash kernel (fp32, AMX) instead of tiles of products
    run_decode: bool  # bf16 decode as products over runs of blocks read in place
    kernel_decode: bool  # decode (and prefill chunks of up to 8 tokens) in the compiled kernel
    cascade_decode_batch: int | None  # with AMX, decode batches this large sharing a prefix go in cascade
    cascade_decode_min_reads: int  # ... once the prefix's tokens x the sequences reach this
    grouped_decode: bool = True  # a decode batch in groups sharing prefixes: each prefix attended once
    kernel_after_sharing: bool = False  # fp32: prefixes shared in the batch attended once, the kernel the rest

    @classmethod
    def for_engine(cls, dtype: torch.dtype, head_dim: int, block_size: int) -> "AttentionPaths":
        bf16 = dtype != torch.float32
        kernel = decode_kernel_supports(dtype, head_dim)  # fp32 without it keeps the masked path's batched rows
        return cls(block_size, tiled_prefill=bf16 or kernel, flash_prefill=prefill_kernel(dtype) == "flash",
                   run_decode=bf16, kernel_decode=kernel,
                   cascade_decode_batch=CASCADE_DECODE_MIN_BATCH if matrix_isa() == "amx" else None,
                   cascade_decode_min_reads=CASCADE_DECODE_MIN_SHARED_READS, kernel_after_sharing=not bf16)

    def prefill(self, seqs: list[Sequence], contexts: list[torch.Tensor], starts: list[int], deterministic: bool):
        """The batch of a pass over a chunk of each sequence: contexts[n] [len_n] slots up to the
        chunk's end, starts[n] the chunk's first position."""
        if deterministic:
            return FixedBatch(list(zip(contexts, starts)))
        if self.tiled_prefill:
            return TiledPrefillBatch.build(contexts, starts, kernel_rows=self.kernel_decode, flash=self.flash_prefill)
        shared = self.cascade_prefix(seqs, min(starts))  # tokens every context starts with, attended apart
        batch = prefill_parts([(c[start:], c[shared:], start - shared) for c, start in zip(contexts, starts)])
        return CascadeBatch(seqs[0].slots(0, shared, self.block_size), batch) if shared else batch

    def decode(self, seqs: list[Sequence], slots: torch.Tensor, lengths: list[int], write: torch.Tensor,
               deterministic: bool):
        """The batch of a decode step: slots [B, max(lengths)] each context's slots (its new token's
        included, padded past lengths[b]), write [B] the new tokens' slots."""
        contexts = [row[:n] for row, n in zip(slots, lengths)]
        tables = [s.block_table for s in seqs]
        if deterministic:
            return FixedBatch([(c, len(seq)) for c, seq in zip(contexts, seqs)])
        if self.kernel_decode and self.kernel_after_sharing:
            return self._decode_sharing_then_kernel(seqs, slots, lengths, write, contexts, tables)
        if self.kernel_decode and not decode_in_cascade(tables, self.block_size, self.cascade_decode_batch,
                                                        self.cascade_decode_min_reads):
            return self._kernel_batch(write, slots, lengths)
        if self.run_decode and reads_in_place_pays([c.numel() for c in contexts], tables, self.block_size):
            return RunsDecodeBatch.build(write, contexts)
        shared = self.cascade_prefix(seqs, len(seqs[0]), decode=True)
        if self.run_decode and not shared:
            return GatheredDecodeBatch.build(write, contexts)
        groups = self._prefix_groups(tables)
        if groups:  # several documents, each shared by a group: each attended once for its group
            return grouped_cascade.build(write, contexts, groups, self.block_size)
        if shared and self.kernel_decode:  # the kernel attends each rest and merges the prefix's part
            return self._kernel_batch(write, slots, lengths, shared)
        batch = AttentionBatch.decode(write, [c[shared:] for c in contexts])
        return CascadeBatch(contexts[0][:shared], batch) if shared else batch

    def _decode_sharing_then_kernel(self, seqs, slots, lengths, write, contexts, tables):
        """fp32 decode: each prefix a group of the batch shares attended once for the group (flash
        over it), every sequence's remainder read in place by the kernel, which merges the two."""
        groups = self._prefix_groups(tables)
        if groups:
            return grouped_cascade.build(write, contexts, groups, self.block_size, kernel=True)
        shared = self.cascade_prefix(seqs, len(seqs[0]), decode=True) if len(seqs) > 1 else 0
        return self._kernel_batch(write, slots, lengths, shared)

    def _prefix_groups(self, tables: list[list[int]]) -> list[tuple[list[int], int]]:
        """The groups of a decode batch that share prefixes, when grouped decode is on (`prefix_groups`)."""
        return prefix_groups(tables, self.block_size) if self.grouped_decode and len(tables) > 2 else []

    @staticmethod
    def _kernel_batch(write: torch.Tensor, slots: torch.Tensor, lengths: list[int], shared: int = 0):
        """Each row's slots past the first `shared` read in place by the kernel; the shared ones, if
        any, attended once for every row (cascade), the kernel merging the two parts."""
        if not shared:
            return KernelDecodeBatch(write, KernelReads(slots, torch.tensor(lengths)))
        rest = KernelReads(slots[:, shared:].contiguous(), torch.tensor(lengths) - shared)
        return CascadeBatch(slots[0, :shared], KernelDecodeBatch(write, rest))

    def cascade_prefix(self, seqs: list[Sequence], first_new: int, decode: bool = False) -> int:
        """Tokens at the start of every context that attention reads once, apart from the rest
        (cascade): the blocks several sequences share, or one sequence's leading run of blocks
        (read in place). `first_new`: the earliest position written in this pass (one sequence)."""
        bs = self.block_size
        if len(seqs) > 1:
            return shared_prefix_blocks([seq.block_table for seq in seqs], bs) * bs
        return leading_run_blocks(seqs[0].block_table, first_new // bs, bs, decode) * bs
