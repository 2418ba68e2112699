"""Warming a shared prefix in chunks that ride on the decode steps of its replica.

A shared prefix computed in one materialize call holds every agent decoding on its replica for the
whole prefill: a cold document of 700 tokens is seconds on a CPU, and under a stream of arriving
workflows the early ones decode one token per arrival. While agents decode on the replica, the
prefix is instead prefilled into a scratch session, WARM_CHUNK_TOKENS at a time: each chunk is a
prompt segment, so it packs into the next mixed step with the decode of every agent there (as
vLLM and Sarathi-style chunked prefill do for prompts). The materialize call that follows finds
the prefix's full blocks in the prefix cache, computes the last partial block only, and the scratch
session closes after it. A chunk that found its tokens cached (a document another run computed),
or the end of decoding on the replica, sends the rest with the materialize call at once.

Faults: a warm-up whose chunk is refused for KV, or whose replica dies, is abandoned (the prefix's
materialize is queued as it would have been, or `PrefixSharing` fetches it anew); a failed run's
cleanup closes the scratch sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from aaflow.runtime.calls import CloseCall, MaterializeCall, OpenCall, PrefillCall

if TYPE_CHECKING:
    from aaflow.runtime.scheduler import Scheduler

WARM_CHUNK_TOKENS = 128  # prompt tokens a warm-up adds to one decode step


@dataclass
class _Warmup:
    sid: str  # the scratch session
    replica: str
    token_ids: list[int]
    then: Callable  # then(record, computed): what the materialize call's record goes to
    fed: int = 0  # tokens prefilled into the scratch session so far
    computed: int = 0  # of those, the tokens computed (not served by the prefix cache)


class PrefixWarmups:
    """Owns the warm-ups in progress: scratch session id -> its warm-up."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.active: dict[str, _Warmup] = {}
        self._count = 0

    def materialize(self, replica: str, token_ids: list[int], then: Callable) -> None:
        """Queue the materialization of `token_ids` on `replica`: at once, or warmed in chunks first
        while agents decode there. `then(record, warmed)` when it is made: `warmed` is the tokens the
        warm-up computed (the record counts those its own call computed)."""
        s = self.scheduler
        if len(token_ids) <= WARM_CHUNK_TOKENS or not s.decoding[replica]:
            s.queues.call(replica, MaterializeCall(token_ids), then=lambda record: then(record, 0))
            return
        warmup = _Warmup(f"{s.run_id}/warmup#{self._count}", replica, token_ids, then)
        self._count += 1
        self.active[warmup.sid] = warmup
        s.queues.call(replica, OpenCall(warmup.sid), then=lambda _: self._feed(warmup))

    def _feed(self, warmup: _Warmup) -> None:
        """Queue the next chunk, or the materialize call when the rest goes at once."""
        if self.active.get(warmup.sid) is not warmup:  # abandoned
            return
        s = self.scheduler
        if len(warmup.token_ids) - warmup.fed <= WARM_CHUNK_TOKENS or not s.decoding[warmup.replica]:
            self._finish(warmup)
            return
        chunk = warmup.token_ids[warmup.fed:warmup.fed + WARM_CHUNK_TOKENS]
        if warmup.fed == 0:
            s.fresh_sids.add(warmup.sid)  # packing counts what it shares with other first segments
        s.queues.call(warmup.replica, PrefillCall(warmup.sid, chunk), then=lambda out: self._fed(warmup, len(chunk), out))

    def _fed(self, warmup: _Warmup, tokens: int, out: dict) -> None:
        self.scheduler.fresh_sids.discard(warmup.sid)
        if self.active.get(warmup.sid) is not warmup:
            return
        warmup.fed += tokens
        warmup.computed += out["computed"]
        if out["computed"] == 0:  # cached already: the materialize call reuses the rest too
            self._finish(warmup)
        else:
            self._feed(warmup)

    def _finish(self, warmup: _Warmup) -> None:
        """The materialize call (which reuses the warmed blocks), then the scratch session's close."""
        del self.active[warmup.sid]
        queues = self.scheduler.queues
        queues.call(warmup.replica, MaterializeCall(warmup.token_ids),
                    then=lambda record: warmup.then(record, warmup.computed))
        queues.call(warmup.replica, CloseCall(warmup.sid))

    def abandon(self, sid: str) -> bool:
        """The replica refused the warm-up's chunk for lack of KV: close its session and materialize
        the prefix as it would have been (a refusal of that preempts its waiters). False when `sid`
        is no warm-up's."""
        warmup = self.active.get(sid)
        if warmup is None:
            return False
        self.scheduler.fresh_sids.discard(sid)
        self._finish(warmup)
        return True

    def replica_died(self, replica: str) -> None:
        """Forget the warm-ups of a dead replica (its prefixes are fetched anew by `PrefixSharing`)."""
        for sid in [sid for sid, w in self.active.items() if w.replica == replica]:
            del self.active[sid]

    def open_sessions(self) -> list[tuple[str, CloseCall]]:
        """(replica, close call) for every scratch session open on a live replica: a failed run's cleanup."""
        dead = self.scheduler.dead
        return [(w.replica, CloseCall(sid)) for sid, w in self.active.items() if w.replica not in dead]
