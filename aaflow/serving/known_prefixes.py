"""Prefixes shared before, across workflows: a request whose prompt begins with one forks it.

A hinted workflow's later requests share a token prefix with its first request
(`aaflow.serving.workflows.HintedWorkflows`): a chat header and a document, typically. That prefix
is remembered here too, so that a request of another workflow, or one without hints, whose prompt
begins with it reads the same KV object: the document's KV is computed once for the deployment and,
where the request is placed on a replica that lacks it, moved there or computed there as the cost
model says, instead of being recomputed wherever a replica's prefix cache lacks it. (Many workflows
over few documents is the common shape: a burst of them otherwise computes each document once per
workflow whose first request lands on a replica without it.)

A prefix is found by its model and its first `header + MIN_SHARED_TOKENS` token ids; the longest
remembered prefix the prompt begins with, short of the prompt's last token, is the one shared.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from aaflow.common.strategies import DEFAULT_BLOCK_TOKENS

MIN_SHARED_TOKENS = DEFAULT_BLOCK_TOKENS  # a shared prefix must hold a KV block beyond the chat header
FORGET_AFTER_S = 600.0  # a prefix no request has begun with for this long is forgotten
STARTS_KEPT = 4096  # distinct prefix starts remembered (the least recently used go first)
PER_START = 8  # prefixes remembered per start (the most recent)
# A request that forks a prefix other workflows shared keeps it this long after its run: at a few
# workflows a second over a few documents, the next reader of a document comes within seconds, and
# would otherwise find it freed and make it again (a call in front of it). Kept only while no agent
# waits for KV room (`RunService._release_kept`): a keep uses room nobody wants.
KEEP_KNOWN_S = 10.0


class KnownPrefixes:
    """The shared prefixes of the deployment's recent requests (thread-safe)."""

    def __init__(self) -> None:
        # (model, the prefix's first header + MIN_SHARED_TOKENS ids) -> {prefix ids: last seen}
        self._by_start: OrderedDict[tuple, dict[tuple[int, ...], float]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, model: str, prefix: tuple[int, ...], header: int) -> None:
        """`prefix` (its first `header` ids the chat header) was shared between two requests."""
        if len(prefix) - header < MIN_SHARED_TOKENS:
            return
        start = (model, tuple(prefix[:header + MIN_SHARED_TOKENS]))
        now = time.monotonic()
        with self._lock:
            known = self._by_start.setdefault(start, {})
            self._by_start.move_to_end(start)
            known[tuple(prefix)] = now
            if len(known) > PER_START:
                del known[min(known, key=known.get)]
            while len(self._by_start) > STARTS_KEPT:
                self._by_start.popitem(last=False)

    def longest(self, model: str, ids: tuple[int, ...], header: int) -> int:
        """The length of the longest remembered prefix that `ids` (a prompt, `header` of them its
        chat header) begin with, short of their last token; 0 for none."""
        if len(ids) - 1 - header < MIN_SHARED_TOKENS:
            return 0
        start = (model, tuple(ids[:header + MIN_SHARED_TOKENS]))
        now = time.monotonic()
        with self._lock:
            known = self._by_start.get(start)
            if not known:
                return 0
            for prefix in [p for p, seen in known.items() if now - seen > FORGET_AFTER_S]:
                del known[prefix]
            fitting = [p for p in known if len(p) < len(ids) and tuple(ids[:len(p)]) == p]
            if not fitting:
                return 0
            best = max(fitting, key=len)
            known[best] = now
            self._by_start.move_to_end(start)
            return len(best)
