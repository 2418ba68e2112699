"""Fair admission of prompts across the runs that share a replica's KV pool.

Each run's scheduler admits as if it owned the pool; when the pool is short the replica refuses
a call and that run preempts and retries later. Without an order across runs, many runs then
keep taking the blocks one another waits for, and the runs that need the most never get in. This
queue gives the order: the first run refused for lack of blocks becomes the head, and until it
is served no other run may start a prompt that would leave it short. The head is served when its
next prompt call succeeds; a head that stops asking (its run ended or failed) is dropped after
STALE_HEAD_S. Decode steps are never held back: the sequences they extend already hold KV and
will free it when they end.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from aaflow.common.errors import KVCapacityError

STALE_HEAD_S = 10.0  # a refused run retries within 2 s (its longest backoff); this long silent, it is gone


@dataclass
class _Waiting:
    needed_blocks: int
    last_seen: float


def run_of(sid: str) -> str:
    """The run a session belongs to: session ids are "<run id>/<agent>#<restarts>"."""
    return sid.split("/", 1)[0]


class KVQueue:
    """Refused runs in the order they were first refused, and the check that keeps their place."""

    def __init__(self, engine, clock=time.monotonic) -> None:
        self.engine, self.clock = engine, clock
        self.waiting: OrderedDict[str, _Waiting] = OrderedDict()

    def admit(self, sids: list[str], new_tokens: int) -> None:
        """Before prompt calls of these sessions that add `new_tokens` tokens: raise
        `KVCapacityError` if they would leave an earlier refused run without its blocks."""
        head = self._head()
        runs = {run_of(s) for s in sids}
        if head is None or not sids or head in runs:
            return
        block_size = self.engine.runner.layout.block_size
        needed = -(-new_tokens // block_size) + len(sids)  # every session may open a partial block
        free = self.engine.stats().free
        if free - needed < self.waiting[head].needed_blocks:
            raise KVCapacityError(needed, max(0, free - self.waiting[head].needed_blocks),
                                  hint=f"blocks held for run {head}, refused earlier; this run waits its turn")

    def refused(self, sids: list[str], exc: KVCapacityError) -> None:
        """A prompt call of these sessions was refused: their runs join the queue (or keep their place)."""
        now = self.clock()
        for run in dict.fromkeys(run_of(s) for s in sids):
            entry = self.waiting.setdefault(run, _Waiting(exc.needed_blocks, now))
            entry.needed_blocks, entry.last_seen = exc.needed_blocks, now

    def served(self, sids: list[str]) -> None:
        """A prompt call of these sessions went through: their runs leave the queue."""
        for run in {run_of(s) for s in sids}:
            self.waiting.pop(run, None)

    def _head(self) -> str | None:
        now = self.clock()
        while self.waiting:
            run, entry = next(iter(self.waiting.items()))
            if now - entry.last_seen <= STALE_HEAD_S:
                return run
            del self.waiting[run]
        return None
