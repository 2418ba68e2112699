"""Sequences on the paged KV pool: prefill (one pass, chunked or packed), batched decode, fork, export/import.

This is the engine's KV protocol; `Engine` adds tokenization and generation on top.
"""

from __future__ import annotations

import itertools

import torch

from aaflow.engine.attention_paths import AttentionPaths
from aaflow.engine.block_manager import BlockManager, BlockStats
from aaflow.engine.kv_cache import KVLayout, PagedKVCache
from aaflow.engine.kv_io import KVImportExport
from aaflow.engine.model import LlamaModel
from aaflow.engine.prefix_reuse import PrefixReuse
from aaflow.engine.sequence import Sequence, padded_slots
from aaflow.common.errors import InvalidArgumentError, PromptError, SequenceError


class KVRunner(PrefixReuse, KVImportExport):
    def __init__(self, model: LlamaModel, layout: KVLayout, fingerprint: str, prefix_caching: bool = True) -> None:
        self.model = model
        self.layout = layout
        self.fingerprint = fingerprint
        self.prefix_caching = prefix_caching
        self.cache = PagedKVCache(layout)
        self.blocks = BlockManager(layout.num_blocks, layout.block_size)
        self.sequences: dict[int, Sequence] = {}
        self._ids = itertools.count(1)
        self.paths = AttentionPaths.for_engine(model.dtype, layout.head_dim, layout.block_size)

    # --- lifecycle ------------------------------------------------------------------------
    def new_sequence(self) -> int:
        seq = Sequence(next(self._ids))
        self.sequences[seq.seq_id] = seq
        return seq.seq_id

    def get(self, seq_id: int) -> Sequence:
        try:
            return self.sequences[seq_id]
        except KeyError:
            raise SequenceError(f"unknown sequence {seq_id}: never created or already freed") from None

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (sealed ones stay in the prefix cache until reused)."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            raise SequenceError(f"unknown sequence {seq_id}: never created or already freed")
        for block in seq.block_table:
            self.blocks.release(block)

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block of `seq_id`; a shared block is copied when written."""
        src = self.get(seq_id)
        child = Sequence(next(self._ids), list(src.token_ids), list(src.block_table), src.num_sealed, src.last_hash,
                         src.cacheable)
        for block in child.block_table:
            self.blocks.share(block)
        self.sequences[child.seq_id] = child
        return child.seq_id

    def stats(self) -> BlockStats:
        return self.blocks.stats()

    # --- growing sequences ----------------------------------------------------------------
    def _check_positions(self, seq: Sequence, num_new: int) -> None:
        limit = self.model.config.max_position_embeddings
        if len(seq) + num_new > limit:
            raise PromptError(
                f"sequence {seq.seq_id} would reach {len(seq) + num_new} tokens, beyond the model's "
                f"{limit} positions; shorten the prompt or max_new_tokens"
            )

    def _grow(self, seq: Sequence, num_new: int) -> None:
        """Make room for `num_new` more tokens: copy a shared last block, allocate new ones."""
        bs = self.layout.block_size
        if len(seq) % bs and self.blocks.ref_counts[seq.block_table[-1]] > 1:
            shared = seq.block_table[-1]
            private = self.blocks.allocate()
            self.cache.copy_block(shared, private)
            self.blocks.release(shared)
            seq.block_table[-1] = private
        for _ in range(self.blocks.blocks_needed(len(seq), num_new)):
            seq.block_table.append(self.blocks.allocate())

    def _blocks_to_grow(self, seqs: list[Sequence], num_new: int) -> int:
        bs = self.layout.block_size
        needed = 0
        for seq in seqs:
            needed += self.blocks.blocks_needed(len(seq), num_new)
            if len(seq) % bs and self.blocks.ref_counts[seq.block_table[-1]] > 1:
                needed += 1
        return needed

    def _seal_full_blocks(self, seq: Sequence) -> None:
        if not (self.prefix_caching and seq.cacheable):
            return
        bs = self.layout.block_size
        while seq.num_sealed < len(seq) // bs:
            i = seq.num_sealed
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            seq.last_hash = self.blocks.seal(seq.block_table[i], seq.last_hash, tokens)
            seq.num_sealed += 1

    def prefill(self, seq_id: int, token_ids: list[int], chunk_size: int | None = None,
                all_logits: bool = False, reuse_prefix: bool = True) -> torch.Tensor:
        """Append `token_ids` at the next positions of a sequence; returns the last token's logits [vocab]
        (with `all_logits`, the logits of every computed token: [n_computed, vocab]).

        The cached blocks that continue the sequence are reused first (`PrefixReuse`; not with
        `reuse_prefix` False: the text-passing baseline computes everything). `chunk_size` splits the work into
        forward passes of at most that many tokens (incremental prefill); results equal one pass.
        Capacity is checked before anything changes: on `KVCapacityError` the sequence is untouched.
        """
        seq = self.get(seq_id)
        token_ids = list(token_ids)
        if not token_ids:
            raise PromptError("cannot prefill an empty list of tokens")
        bad_chunk = not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
        if chunk_size is not None and bad_chunk:
            raise InvalidArgumentError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
        self._check_positions(seq, len(token_ids))
        reused = self._reuse_prefix(seq, token_ids) if reuse_prefix else 0
        remaining = token_ids[reused:] if reused else token_ids
        self.blocks.check_capacity(self._blocks_to_grow([seq], len(remaining)))
        step = chunk_size or len(remaining)
        chunks = [self._forward_chunk(seq, remaining[i : i + step], all_logits)
                  for i in range(0, len(remaining), step)]
        return torch.cat(chunks) if all_logits else chunks[-1][0]

    def prefill_packed(self, seq_ids: list[int], token_lists: list[list[int]],
                       reuse_prefix: list[bool] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Prefill one token list for each of several sequences in as few forward passes as possible
        (each pass reads the weights once for all of its sequences); returns each list's last-token
        logits [n, vocab] and how many of its tokens came from the prefix cache.

        Each sequence gets what `prefill` would give it, prefix-cache reuse included
        (`reuse_prefix[i]`, default True): a member whose next full block another member of
        the pack is about to compute waits for the next pass and then reuses it, so a prefix shared
        inside the pack is computed once. Capacity is checked before anything changes."""
        reuse = list(reuse_prefix) if reuse_prefix is not None else [True] * len(seq_ids)
        if not seq_ids or not len(seq_ids) == len(token_lists) == len(reuse):
            raise ValueError("prefill_packed needs one token list (and reuse flag) per sequence, at least one")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one packed prefill: {seq_ids}")
        seqs = [self.get(s) for s in seq_ids]
        lists = [list(t) for t in token_lists]
        for seq, ids in zip(seqs, lists):
            if not ids:
                raise PromptError(f"cannot prefill an empty list of tokens (sequence {seq.seq_id})")
            self._check_positions(seq, len(ids))
        self._check_packed_capacity(seqs, lists, reuse)
        logits: list[torch.Tensor | None] = [None] * len(seqs)
        reused = [0] * len(seqs)
        pending = list(range(len(seqs)))
        while pending:
            wave, pending = self._next_wave(seqs, lists, reuse, pending)
            remaining = []
            for i in wave:
                reused[i] = self._reuse_prefix(seqs[i], lists[i]) if reuse[i] else 0
                remaining.append(lists[i][reused[i]:])
            for i, row in zip(wave, self._forward_chunks([seqs[i] for i in wave], remaining)):
                logits[i] = row
        return torch.stack(logits), reused  # [n, vocab]

    def _forward_chunk(self, seq: Sequence, chunk: list[int], all_logits: bool = False) -> torch.Tensor:
        return self._forward_chunks([seq], [chunk], all_logits)

    def _forward_chunks(self, seqs: list[Sequence], chunks: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """One forward pass over a chunk of each sequence; logits of each chunk's last token [n, vocab]
        (with `all_logits`, of every token: [sum of chunk lengths, vocab])."""
        bs = self.layout.block_size
        starts = [len(seq) for seq in seqs]
        for seq, chunk in zip(seqs, chunks):
            self._grow(seq, len(chunk))
        contexts = [seq.slots(0, start + len(chunk), bs) for seq, chunk, start in zip(seqs, chunks, starts)]
        positions = [torch.arange(start, start + len(chunk)) for chunk, start in zip(chunks, starts)]
        batch = self.paths.prefill(seqs, contexts, starts, self.model.deterministic)
        ids = torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.long)  # [T]
        rows = None if all_logits else torch.tensor([len(c) for c in chunks]).cumsum(0) - 1
        logits = self.model.forward(ids, torch.cat(positions), self.cache, batch, logit_rows=rows)
        for seq, chunk in zip(seqs, chunks):
            seq.token_ids.extend(chunk)
            self.blocks.tokens_computed += len(chunk)
            self._seal_full_blocks(seq)
        return logits  # [rows, vocab]

    def decode(self, seq_ids: list[int], token_ids: list[int]) -> torch.Tensor:
        """Append one token to each sequence in one batched pass; returns logits [B, vocab]."""
        if len(seq_ids) != len(token_ids) or not seq_ids:
            raise ValueError("decode needs one token per sequence and at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one decode batch: {seq_ids}")
        seqs = [self.get(s) for s in seq_ids]
        for seq in seqs:
            self._check_positions(seq, 1)
        self.blocks.check_capacity(self._blocks_to_grow(seqs, 1))
        bs = self.layout.block_size
        for seq in seqs:
            self._grow(seq, 1)
        lengths = [len(seq) + 1 for seq in seqs]  # each context, its new token's included
        slots = padded_slots(seqs, lengths, bs)  # [B, max(lengths)]
        write = slots[torch.arange(len(seqs)), torch.tensor(lengths) - 1]  # [B]
        positions = torch.tensor([len(seq) for seq in seqs])
        batch = self.paths.decode(seqs, slots, lengths, write, self.model.deterministic)
        logits = self.model.forward(torch.tensor(token_ids), positions, self.cache, batch)
        for seq, tok in zip(seqs, token_ids):
            seq.token_ids.append(tok)
            self._seal_full_blocks(seq)
        self.blocks.tokens_computed += len(seqs)
        return logits
