"""Fault injection for reliability tests: make a replica fail for real at a chosen moment."""

from __future__ import annotations

import os


class FaultInjection:
    """A replica's armed fault (at most one); the replica asks it at the moments a fault may strike.
    `inject(kind, after)` arms one:

    - "crash": the replica process exits (os._exit) on its `after`-th decode step;
    - "error": its `after`-th decode step raises RuntimeError (the agent fails);
    - "transfer": its next `after` transfers (receive) raise KVTransferError;
    - "stale": its next `after` exposures are released at the source before any peer reads them, so
      the peer's fetch meets a stale lease inside the real transport.
    """

    def __init__(self) -> None:
        self.armed: tuple[str, int] | None = None  # (kind, events left before it strikes)

    def inject(self, kind: str, after: int = 1) -> None:
        """Arm `kind` (replacing whatever was armed); ValueError for an unknown kind."""
        if kind not in ("crash", "error", "transfer", "stale"):
            raise ValueError(f"unknown fault {kind!r}: use crash, error, transfer or stale")
        self.armed = (kind, after)

    def clear(self) -> None:
        """Disarm whatever fault is armed."""
        self.armed = None

    def stale_exposure(self) -> bool:
        """Whether a "stale" fault claims this exposure (counting it down)."""
        if self.armed is None or self.armed[0] != "stale":
            return False
        left = self.armed[1] - 1
        self.armed = ("stale", left) if left > 0 else None
        return True

    def maybe_fail(self, where: str) -> None:
        """Count down an armed fault that strikes at `where` ("step" or "receive"); strike at zero."""
        if self.armed is None or self.armed[0] == "stale":
            return
        kind, left = self.armed
        if (kind == "transfer") != (where == "receive"):
            return
        left -= 1
        self.armed = (kind, left) if left > 0 else None
        if kind == "transfer":
            from aaflow.errors import KVTransferError

            raise KVTransferError("injected transfer failure")
        if left <= 0 and kind == "crash":
            os._exit(1)
        if left <= 0:
            raise RuntimeError("injected agent failure")
