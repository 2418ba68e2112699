"""Calibration microbenchmarks that run inside a replica (its engine, its threads).

The driver (`aaflow.cluster.calibration`) collects the samples from every replica and fits a hardware
profile with `aaflow.costmodel.fitting`. Samples are (tokens or batch, context tokens, seconds).
"""

from __future__ import annotations

import statistics
import time

import torch

QUICK_PREFILL = ((32, 0), (128, 0), (512, 0), (1024, 0), (2048, 0), (32, 1024), (256, 1024), (128, 2048))
QUICK_DECODE = ((1, 64), (4, 64), (8, 64), (1, 1024), (4, 1024))
FULL_PREFILL = QUICK_PREFILL + ((16, 0), (64, 0), (4096, 0), (512, 2048), (16, 4096), (256, 4096))
FULL_DECODE = QUICK_DECODE + ((16, 64), (16, 1024), (1, 4096), (8, 2048))
PACK_MEMBERS, PACK_TOKENS, PACK_CONTEXT = 8, 4, 256  # a pack of streamed increments (short: first-use calibration pays it)


class Calibration:
    """The microbenchmarks of a built-in replica, run on its engine (`replica.engine`); links
    through its `receive` and `free`."""

    def __init__(self, replica) -> None:
        self.replica, self.engine = replica, replica.engine

    def _random_ids(self, n: int, seed: int) -> list[int]:
        vocab = self.engine.config.vocab_size
        g = torch.Generator().manual_seed(seed)
        return torch.randint(10, vocab - 10, (n,), generator=g).tolist()

    def _fits(self, tokens: int, sequences: int = 1) -> bool:
        """Positions allow `tokens`, and the pool has blocks for `sequences` of them (half of it at most)."""
        lay = self.engine.kv_layout
        blocks = sequences * -(-tokens // lay.block_size)
        return tokens <= self.engine.config.max_position_embeddings and blocks <= lay.num_blocks // 2

    def calibrate_prefill(self, points=QUICK_PREFILL, repeats: int = 1) -> list[tuple[int, int, float]]:
        """Seconds to prefill `new` tokens after `context` tokens (no prefix cache), median of repeats."""
        samples = []
        self._time_prefill(16, 0, seed=0)  # warm-up
        for i, (new, context) in enumerate(points):
            if not self._fits(new + context):
                continue
            times = [self._time_prefill(new, context, seed=100 * i + r) for r in range(repeats)]
            samples.append((new, context, statistics.median(times)))
        self.replica.clear_prefix_cache()
        return samples

    def _time_prefill(self, new: int, context: int, seed: int) -> float:
        seq = self.engine.new_sequence()
        try:
            if context:
                self.engine.prefill(seq, self._random_ids(context, seed + 1), reuse_prefix=False)
            ids = self._random_ids(new, seed)
            t0 = time.perf_counter()
            self.engine.prefill(seq, ids, reuse_prefix=False)
            return time.perf_counter() - t0
        finally:
            self.engine.free(seq)

    def calibrate_decode(self, points=QUICK_DECODE, steps: int = 12) -> list[tuple[int, int, float]]:
        """Seconds per batched decode step of `batch` sequences holding `context` tokens each."""
        samples = []
        for i, (batch, context) in enumerate(points):
            if not self._fits(context + steps + 1, batch):
                continue
            seqs = [self.engine.new_sequence() for _ in range(batch)]
            try:
                for j, seq in enumerate(seqs):
                    self.engine.prefill(seq, self._random_ids(context, 1000 * i + j), reuse_prefix=False)
                tokens = [self._random_ids(1, j)[0] for j in range(batch)]
                times = []
                for _ in range(steps + 1):
                    t0 = time.perf_counter()
                    self.engine.decode(seqs, tokens)
                    times.append(time.perf_counter() - t0)
                samples.append((batch, context, statistics.median(times[1:])))
            finally:
                for seq in seqs:
                    self.engine.free(seq)
        self.replica.clear_prefix_cache()
        return samples

    def calibrate_packing(self, members: int = PACK_MEMBERS, tokens: int = PACK_TOKENS, context: int = PACK_CONTEXT,
                          repeats: int = 3) -> list[tuple[int, int, int, float]]:
        """(members, new tokens each, context tokens each, seconds) of one packed prefill of 1 and of
        `members` sequences, median of repeats: what each extra member of a pack costs beyond its tokens."""
        if not self._fits(context + tokens * (repeats + 1), members):
            return []
        seqs = [self.engine.new_sequence() for _ in range(members)]
        try:
            for j, seq in enumerate(seqs):
                self.engine.prefill(seq, self._random_ids(context, 5000 + j), reuse_prefix=False)
            samples = []
            for n in (1, members):
                times = []
                for r in range(repeats):
                    chunks = [self._random_ids(tokens, 7000 + 100 * r + j) for j in range(n)]
                    t0 = time.perf_counter()
                    self.engine.prefill_packed(seqs[:n], chunks)
                    times.append(time.perf_counter() - t0)
                samples.append((n, tokens, context, statistics.median(times)))
            return samples
        finally:
            for seq in seqs:
                self.engine.free(seq)
            self.replica.clear_prefix_cache()

    def calibrate_receive(self, handle, shape, record, transport: str) -> tuple[int, float]:
        """Time a whole `receive` (fetch + import into the pool) and drop what arrived: (bytes, seconds)."""
        t0 = time.perf_counter()
        received = self.replica.receive(handle, shape, record, transport)
        seconds = time.perf_counter() - t0
        self.replica.free(received.record.id)
        return received.stats.nbytes, seconds
