"""Prefix-cache reuse when prompt tokens are appended to a sequence (`KVRunner`'s prefill paths).

A prefill first adopts the cached blocks that continue the sequence with its new tokens: on an
empty sequence the longest cached prefix of the prompt; on one that already holds tokens (a session
forked from a shared document's KVRef, a received move) the cached blocks past its own, its partial
last block replaced by the cached full block that begins with the same tokens. So agents whose
prompts continue one document with the same words compute those words once, whether each began
from text or from the document's ref. Approximate KV (`Sequence.cacheable` False) never adopts
cached blocks, as it never offers its own.
"""

from __future__ import annotations

from aaflow.engine.block_manager import full_block_hashes
from aaflow.engine.sequence import Sequence


class PrefixReuse:
    """Mixed into `KVRunner` (needs its `blocks`, `layout`, `prefix_caching` and `_blocks_to_grow`)."""

    def _looks_up_prefix(self, seq: Sequence, reuse: bool) -> bool:
        """Whether prefilling `seq` starts with a prefix-cache lookup (as `_reuse_prefix` does)."""
        return reuse and self.prefix_caching and seq.cacheable

    def _reuse_prefix(self, seq: Sequence, token_ids: list[int]) -> int:
        """Adopt the cached blocks that continue `seq` with `token_ids`; returns how many of
        `token_ids` they cover (0: nothing cached continues it). Capacity for the rest is checked
        before anything changes."""
        if not self._looks_up_prefix(seq, True):
            return 0
        bs, held = self.layout.block_size, len(seq)
        matched, last_hash = self.blocks.match_prefix(seq.token_ids + token_ids if held else token_ids)
        own = held // bs  # the sequence's full blocks: kept (a match covers the same tokens)
        n = len(matched) * bs
        if n <= held:
            return 0
        adopted = matched[own:]
        self.blocks.check_capacity(self.blocks.blocks_needed(n, held + len(token_ids) - n),
                                   self.blocks.count_cached_free(adopted))
        for block in adopted:
            self.blocks.share(block)
        if held % bs:  # its partial last block: the adopted block holds the same tokens, and more
            self.blocks.release(seq.block_table[own])
        seq.block_table = seq.block_table[:own] + adopted
        seq.token_ids = (seq.token_ids + token_ids)[:n]
        seq.num_sealed, seq.last_hash = len(matched), last_hash
        self.blocks.tokens_reused += n - held
        return n - held

    def _next_wave(self, seqs, lists, reuse, pending: list[int]) -> tuple[list[int], list[int]]:
        """Split `pending` into the members computed in this pass and those that wait, because an
        earlier member of this pass computes (and caches) the next full block of their prompt."""
        bs = self.layout.block_size
        wave, later = [], []
        for j in pending:
            waits = False
            if self._looks_up_prefix(seqs[j], reuse[j]):
                whole = seqs[j].token_ids + lists[j]
                end = (len(self.blocks.match_prefix(whole)[0]) + 1) * bs  # end of j's next full block
                waits = len(whole) > end and any(
                    seqs[i].cacheable and (seqs[i].token_ids + lists[i])[:end] == whole[:end] for i in wave)
            (later if waits else wave).append(j)
        return wave, later

    def _check_packed_capacity(self, seqs, lists, reuse) -> None:
        """Blocks the pack needs, counting a prompt block as needed once: whether the cache holds it
        or an earlier member of the pack computes (and seals) it, as `_next_wave` arranges."""
        bs = self.layout.block_size
        needed, adopted, planned = 0, set(), set()  # planned: chain hashes earlier members will seal
        for seq, ids, r in zip(seqs, lists, reuse):
            if not self._looks_up_prefix(seq, r):
                needed += self._blocks_to_grow([seq], len(ids))
                continue
            whole = seq.token_ids + ids
            matched = self.blocks.match_prefix(whole)[0]
            adopted.update(matched[len(seq) // bs:])
            hashes = full_block_hashes(whole, bs)
            shared = len(matched)
            while shared < (len(whole) - 1) // bs and hashes[shared] in planned:
                shared += 1
            if shared * bs <= len(seq):  # nothing shared past its own tokens: it grows as it is
                needed += self._blocks_to_grow([seq], len(ids))
            else:
                needed += self.blocks.blocks_needed(shared * bs, len(whole) - shared * bs)
            planned.update(hashes)
        self.blocks.check_capacity(needed, self.blocks.count_cached_free(list(adopted)))
