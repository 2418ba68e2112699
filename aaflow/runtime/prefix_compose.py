"""Composed shared prefixes: a prefix that a compose node asks to compose approximately is made of
its contexts, each materialized alone (so the prefix cache serves it wherever it was computed
before), then composed on the replica (`aaflow.operators.compose`); the parts are freed once composed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from aaflow.runtime.calls import Call, ComposeCall, FreeCall, MaterializeCall
from aaflow.runtime.prefix_key import PlacedPrefix, PrefixKey

if TYPE_CHECKING:
    from aaflow.runtime.call_queues import CallQueues

class Compositions:
    """Owns the compositions under way: per composed prefix and replica, its parts made so far."""

    def __init__(self, queues: CallQueues) -> None:
        self.queues = queues
        self.parts: dict[PlacedPrefix, list] = {}  # a composed prefix's parts' records (None: not made)

    def start(self, prefix: PrefixKey, rname: str, done: Callable[[object, int], None]) -> None:
        """Materialize the prefix's parts on `rname`, then compose them; `done(record, tokens
        computed for it)` once composed."""
        mode, r, lengths = prefix.compose
        key = PlacedPrefix(prefix, rname)
        parts: list = [None] * len(lengths)
        self.parts[key] = parts

        def made(i: int, record) -> None:
            if self.parts.get(key) is not parts:  # abandoned: another part was refused
                self.queues.call(rname, FreeCall(record.id))
                return
            parts[i] = record
            if all(p is not None for p in parts):
                self.queues.call(rname, ComposeCall([p.id for p in parts], mode, r), then=composed)

        def composed(record) -> None:
            del self.parts[key]
            for part in parts:
                self.queues.call(rname, FreeCall(part.id))
            recomputed = record.fidelity.recomputed_tokens if record.fidelity is not None else 0
            done(record, sum(p.computed for p in parts) + recomputed)

        for i, piece in enumerate(pieces(prefix)):
            self.queues.call(rname, MaterializeCall(list(piece)), then=lambda rec, i=i: made(i, rec))

    def abandon(self, prefix: PrefixKey, rname: str) -> None:
        """A part was refused: free the parts made so far (and, as they end, those still coming)."""
        for part in self.parts.pop(PlacedPrefix(prefix, rname), []):
            if part is not None:
                self.queues.call(rname, FreeCall(part.id))

    def let_go(self, dead: set[str]) -> list[tuple[str, Call]]:
        """After a failed run: forget every composition; answers the frees of the parts made on
        live replicas."""
        calls = [(key.replica, FreeCall(part.id)) for key, parts in self.parts.items()
                 for part in parts if part is not None and key.replica not in dead]
        self.parts.clear()
        return calls


def pieces(prefix: PrefixKey) -> list[tuple]:
    """The token tuples materialized for a prefix: itself, or each part of a composed one."""
    if prefix.compose is None:
        return [prefix.ids]
    lengths, start, out = prefix.compose[2], 0, []
    for n in lengths:
        out.append(tuple(prefix.ids[start:start + n]))
        start += n
    return out
