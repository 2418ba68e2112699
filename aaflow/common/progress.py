"""Progress bars for long work a user waits on: calibration, kernel builds, benchmarks (tqdm, on stderr).

Bars draw only on a terminal; the text lines each step also prints stay, for logs.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

from tqdm.auto import tqdm


def _terminal() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def steps(total: int, what: str, unit: str = "step"):
    """A bar over `total` known steps (advance it with `.update()`; close it, or use it as a context)."""
    return tqdm(total=total, desc=what, unit=unit, disable=not _terminal(), leave=False, dynamic_ncols=True)


class Stages:
    """A bar over `total` named stages: `begin(label)` ends the one before; `close()` ends the last.
    `shown=False`: no bar (a caller asked for quiet)."""

    def __init__(self, total: int, what: str, shown: bool = True) -> None:
        self.bar = steps(total, what, unit="stage") if shown else None
        self.begun = 0

    def begin(self, label: str) -> None:
        if self.bar is not None:
            self.bar.update(1 if self.begun else 0)
            self.bar.set_postfix_str(label)
        self.begun += 1

    def add(self, more: int) -> None:
        """`more` stages beyond those counted at the start (work found to be needed on the way)."""
        if self.bar is not None:
            self.bar.total += more
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()


@contextmanager
def timed(what: str, expected_s: float):
    """A bar that fills over the `expected_s` seconds one opaque call is expected to take (a
    compiler, a calibration step), and completes when the call returns, however long it took."""
    bar = tqdm(total=round(expected_s), desc=what, unit="s", disable=not _terminal(), leave=False, dynamic_ncols=True,
               bar_format="{desc}: {bar} {elapsed} (about {total} s expected)")
    done = threading.Event()

    def tick() -> None:
        begin = time.monotonic()
        while not done.wait(0.5):
            bar.n = min(bar.total - 1, int(time.monotonic() - begin))
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True, name="aaflow-progress")
    ticker.start()
    try:
        yield bar
    finally:
        done.set()
        ticker.join()
        bar.n = bar.total
        bar.close()
