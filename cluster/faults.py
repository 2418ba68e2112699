"""Fault injection for reliability tests: make a replica fail for real at a chosen moment."""

from __future__ import annotations

import os


class FaultInjection:
    """Mixin for `ModelReplica`. `inject_fault(kind, after)` arms one fault:

    - "crash": the replica process exits (os._exit) on its `after`-th decode step;
    - "error": its `after`-th decode step raises RuntimeError (the agent fails);
    - "transfer": its next `after` transfers (receive) raise KVTransferError.
    """

    _fault: tuple[str, int] | None = None

    def inject_fault(self, kind: str, after: int = 1) -> None:
        if kind not in ("crash", "error", "transfer"):
            raise ValueError(f"unknown fault {kind!r}: use crash, error or transfer")
        self._fault = (kind, after)

    def _maybe_fail(self, where: str) -> None:
        if self._fault is None:
            return
        kind, left = self._fault
        if (kind == "transfer") != (where == "receive"):
            return
        left -= 1
        self._fault = (kind, left) if left > 0 else None
        if kind == "transfer":
            from aaflow.errors import KVTransferError

            raise KVTransferError("injected transfer failure")
        if left <= 0 and kind == "crash":
            os._exit(1)
        if left <= 0:
            raise RuntimeError("injected agent failure")
