"""The names of shared prefixes: which KV a prefix is (`PrefixKey`), and that KV on one replica
(`PlacedPrefix`). Both are tuples: equal, and hashing equal, to the plain tuples of their fields."""

from __future__ import annotations

from typing import NamedTuple


class PrefixIds(tuple):
    """A static prefix's token ids that hash once: prefix keys are looked up for every agent and
    prefix call, and hashing thousands of ids each time would dominate planning. Equal, and hashing
    equal, to the plain tuple of the same ids."""

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash


class PrefixKey(NamedTuple):
    """A shared prefix: its KV is shared only between replicas of one model, and composed KV only
    with agents that ask for the same compose."""

    model: str
    ids: tuple[int, ...]  # its token ids (a `PrefixIds`)
    compose: tuple | None  # None, or (compose mode, r, the lengths of the contexts composed)


class PlacedPrefix(NamedTuple):
    """A shared prefix on one replica (where it is held, awaited, moved to or computed)."""

    prefix: PrefixKey
    replica: str
