"""Fault injection for reliability tests: make a replica fail for real at a chosen moment."""

from __future__ import annotations

import os


class FaultInjection:
    """Mixin for `ModelReplica`. `inject_fault(kind, after)` arms one fault:

    - "crash": the replica process exits (os._exit) on its `after`-th decode step;
    - "error": its `after`-th decode step raises RuntimeError (the agent fails);
    - "transfer": its next `after` transfers (receive) raise KVTransferError;
    - "stale": its next `after` exposures are released at the source before any peer reads them, so
      the peer's fetch meets a stale lease inside the real transport.
    """

    _fault: tuple[str, int] | None = None

    def inject_fault(self, kind: str, after: int = 1) -> None:
        if kind not in ("crash", "error", "transfer", "stale"):
            raise ValueError(f"unknown fault {kind!r}: use crash, error, transfer or stale")
        self._fault = (kind, after)

    def clear_fault(self) -> None:
        """Disarm whatever fault is armed."""
        self._fault = None

    def _stale_exposure(self) -> bool:
        """Whether a "stale" fault claims this exposure (counting it down)."""
        if self._fault is None or self._fault[0] != "stale":
            return False
        left = self._fault[1] - 1
        self._fault = ("stale", left) if left > 0 else None
        return True

    def _maybe_fail(self, where: str) -> None:
        if self._fault is None or self._fault[0] == "stale":
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
