"""Composed shared prefixes: a prefix that a compose node asks to compose approximately is made of
its contexts, each materialized alone (so the prefix cache serves it wherever it was computed
before), then composed on the replica (`operators.compose`); the parts are freed once composed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from aaflow.runtime.calls import Call, ComposeCall, FreeCall, MaterializeCall

if TYPE_CHECKING:
    from aaflow.runtime.call_queues import CallQueues

Prefix = tuple  # (model, token ids, None or (compose mode, r, the parts' lengths))


class Compositions:
    """Owns the compositions under way: per composed prefix and replica, its parts made so far."""

    def __init__(self, queues: CallQueues) -> None:
        self.queues = queues
        self.parts: dict[tuple, list] = {}  # composed prefix + (replica,) -> its parts' records (None: not made)

    def start(self, prefix: Prefix, rname: str, done: Callable[[object, int], None]) -> None:
        """Materialize the prefix's parts on `rname`, then compose them; `done(record, tokens
        computed for it)` once composed."""
        mode, r, lengths = prefix[2]
        key = prefix + (rname,)
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

    def abandon(self, prefix: Prefix, rname: str) -> None:
        """A part was refused: free the parts made so far (and, as they end, those still coming)."""
        for part in self.parts.pop(prefix + (rname,), []):
            if part is not None:
                self.queues.call(rname, FreeCall(part.id))

    def let_go(self, dead: set[str]) -> list[tuple[str, Call]]:
        """After a failed run: forget every composition; answers the frees of the parts made on
        live replicas."""
        calls = [(key[-1], FreeCall(part.id)) for key, parts in self.parts.items()
                 for part in parts if part is not None and key[-1] not in dead]
        self.parts.clear()
        return calls


def pieces(prefix: Prefix) -> list[tuple]:
    """The token tuples materialized for a prefix: itself, or each part of a composed one."""
    if prefix[2] is None:
        return [prefix[1]]
    lengths, start, out = prefix[2][2], 0, []
    for n in lengths:
        out.append(tuple(prefix[1][start:start + n]))
        start += n
    return out
