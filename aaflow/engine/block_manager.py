"""Block bookkeeping for the paged KV pool: free list, reference counts, prefix-cache index.

Knows block ids and token ids, never tensors. A full block whose KV has been computed is
*sealed*: registered under a hash chained over every token before it, so that a later
sequence with the same prefix reuses it, even while the sequence that made it is still running.
Released sealed blocks stay cached (evictable, least recently released first) until needed.
Plain free blocks are handed out lowest id first, so that a sequence's blocks tend to lie in one
run of the pool: attention and in-place transfers then read them as a few large views.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from aaflow.common.errors import KVCapacityError

NO_HASH = 0


def chain_hash(prev_hash: int, block_tokens: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of everything before it."""
    return hash((prev_hash, block_tokens))


def full_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chain hashes of the full blocks of a sequence holding `token_ids` (as `seal` registers them)."""
    hashes, h = [], NO_HASH
    for i in range(len(token_ids) // block_size):
        h = chain_hash(h, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(h)
    return hashes


@dataclass
class BlockStats:
    """Pool occupancy and prefix-cache effect."""

    num_blocks: int
    used: int  # referenced by at least one sequence
    free: int  # allocatable now, including cached ones
    cached: int  # free but still holding a sealed, reusable block
    tokens_computed: int  # tokens whose KV was computed by a forward pass
    tokens_reused: int  # prompt tokens served from the prefix cache instead


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free_uncached: list[int] = list(range(num_blocks))  # a heap: lowest id first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self._hash_of: dict[int, int] = {}  # sealed block -> its chain hash
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # sealed block -> its tokens (checked on hit)
        self._block_of: dict[int, int] = {}  # chain hash -> sealed block
        self.tokens_computed = 0
        self.tokens_reused = 0

    # --- capacity -------------------------------------------------------------------------
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def blocks_needed(self, num_tokens_now: int, num_new_tokens: int) -> int:
        """Blocks to allocate to grow a sequence from `num_tokens_now` by `num_new_tokens`."""
        have = -(-num_tokens_now // self.block_size)
        need = -(-(num_tokens_now + num_new_tokens) // self.block_size)
        return need - have

    def check_capacity(self, needed: int, reserved: int = 0) -> None:
        """Raise `KVCapacityError` unless `needed` blocks can be allocated (`reserved` are spoken for)."""
        free = self.num_free() - reserved
        if needed > free:
            raise KVCapacityError(needed, free)

    # --- allocation -----------------------------------------------------------------------
    def allocate(self) -> int:
        """Take a free block (the lowest uncached one, else the least recently released cached one)."""
        if self._free_uncached:
            block = heapq.heappop(self._free_uncached)
        elif self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            self._unseal(block)
        else:
            raise KVCapacityError(1, 0)
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """Add a reference to a block (fork, or a prefix-cache hit on a released block)."""
        if self.ref_counts[block] == 0:
            del self._free_cached[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """Drop a reference; at zero the block becomes free (cached if sealed)."""
        assert self.ref_counts[block] > 0, f"block {block} released more often than referenced"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._hash_of:
                self._free_cached[block] = None
            else:
                heapq.heappush(self._free_uncached, block)

    # --- prefix cache ---------------------------------------------------------------------
    def seal(self, block: int, prev_hash: int, tokens: tuple[int, ...]) -> int:
        """Register a full, computed block; returns its chain hash (for the next block)."""
        h = chain_hash(prev_hash, tokens)
        if h not in self._block_of:
            self._block_of[h] = block
            self._hash_of[block] = h
            self._tokens_of[block] = tokens
        return h

    def _unseal(self, block: int) -> None:
        h = self._hash_of.pop(block)
        self._tokens_of.pop(block)
        del self._block_of[h]

    def clear_cache(self) -> None:
        """Forget every sealed block (used ones keep their data; free ones become plain free blocks)."""
        self._block_of.clear()
        self._hash_of.clear()
        self._tokens_of.clear()
        self._free_uncached.extend(self._free_cached)
        heapq.heapify(self._free_uncached)
        self._free_cached.clear()

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], int]:
        """Sealed blocks covering the longest cached prefix of `token_ids` (no references taken).

        Returns (blocks, chain hash of the last one). At least one token is always left
        uncovered, so the caller has a token to compute logits from.
        """
        bs = self.block_size
        blocks: list[int] = []
        h = NO_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            nh = chain_hash(h, tokens)
            block = self._block_of.get(nh)
            if block is None or self._tokens_of[block] != tokens:
                break
            blocks.append(block)
            h = nh
        return blocks, h

    def count_cached_free(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the free (cached) list: taking them shrinks the free count."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def stats(self) -> BlockStats:
        free = self.num_free()
        return BlockStats(
            num_blocks=self.num_blocks,
            used=self.num_blocks - free,
            free=free,
            cached=len(self._free_cached),
            tokens_computed=self.tokens_computed,
            tokens_reused=self.tokens_reused,
        )
