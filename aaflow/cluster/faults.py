"""Fault injection for reliability tests: make a replica fail for real at a chosen moment."""

from __future__ import annotations

import os
import signal
import threading

from aaflow.common.errors import KVTransferError

KILL_POINTS = ("materialize", "prefill", "step", "expose", "receive")


class FaultInjection:
    """A replica's armed fault (at most one); the replica asks it at the moments a fault may strike.
    `inject(kind, after)` arms one:

    - "crash": the replica process exits (os._exit) on its `after`-th decode step;
    - "error": its `after`-th decode step raises RuntimeError (the agent fails);
    - "transfer": its next `after` transfers (receive) raise KVTransferError;
    - "stale": its next `after` exposures are released at the source before any peer reads them, so
      the peer's fetch meets a stale lease inside the real transport;
    - "kill": the process SIGKILLs itself on its `after`-th call that reaches `at` (one of KILL_POINTS),
      `delay_s` after that call starts (a source killed while its peer fetches: at="expose", a delay).
      With `claim` (a file path), of the replicas armed with the same claim only the first to strike
      does: it creates the file; the others find it there and disarm.
    """

    def __init__(self) -> None:
        self.armed: tuple[str, int] | None = None  # (kind, events left before it strikes)
        self.kill_at: tuple[str, float] | None = None  # a "kill" fault: (point, delay_s)
        self.claim: str | None = None  # a "kill" fault's claim file

    def inject(self, kind: str, after: int = 1, at: str | None = None, delay_s: float = 0.0,
               claim: str | None = None) -> None:
        """Arm `kind` (replacing whatever was armed); ValueError for an unknown kind or point."""
        if kind not in ("crash", "error", "transfer", "stale", "kill"):
            raise ValueError(f"unknown fault {kind!r}: use crash, error, transfer, stale or kill")
        if kind == "kill" and at not in KILL_POINTS:
            raise ValueError(f"a kill fault needs at= one of {KILL_POINTS}, got {at!r}")
        self.armed = (kind, after)
        self.kill_at = (at, delay_s) if kind == "kill" else None
        self.claim = claim if kind == "kill" else None

    def clear(self) -> None:
        """Disarm whatever fault is armed."""
        self.armed, self.kill_at, self.claim = None, None, None

    def reached(self, point: str) -> None:
        """A call reached `point`: strike an armed "kill" fault aimed there when its count runs out."""
        if self.kill_at is None or self.kill_at[0] != point:
            return
        kind, left = self.armed
        self.armed = (kind, left - 1)
        if left > 1:
            return
        delay, claim = self.kill_at[1], self.claim
        self.clear()
        if claim is not None:
            try:
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:  # another replica struck first
                return
        if delay <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(delay, os.kill, args=(os.getpid(), signal.SIGKILL)).start()

    def stale_exposure(self) -> bool:
        """Whether a "stale" fault claims this exposure (counting it down)."""
        if self.armed is None or self.armed[0] != "stale":
            return False
        left = self.armed[1] - 1
        self.armed = ("stale", left) if left > 0 else None
        return True

    def maybe_fail(self, where: str) -> None:
        """Count down an armed fault that strikes at `where` ("step" or "receive"); strike at zero."""
        self.reached(where)
        if self.armed is None or self.armed[0] in ("stale", "kill"):
            return
        kind, left = self.armed
        if (kind == "transfer") != (where == "receive"):
            return
        left -= 1
        self.armed = (kind, left) if left > 0 else None
        if kind == "transfer":
            raise KVTransferError("injected transfer failure")
        if left <= 0 and kind == "crash":
            os._exit(1)
        if left <= 0:
            raise RuntimeError("injected agent failure")
