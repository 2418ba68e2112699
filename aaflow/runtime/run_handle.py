"""What a client holds for a run it handed to a scheduling loop (`aaflow.runtime.service`)."""

from __future__ import annotations

import threading

from aaflow.common.errors import AAFlowError
from aaflow.runtime.results import RunResult


class RunCancelledError(AAFlowError, RuntimeError):
    """The run was cancelled (`RunHandle.cancel`, or its client went away) or passed its timeout;
    what it held on the replicas was freed."""


class RunHandle:
    """A run handed to a `RunService`: `result()` waits for its `RunResult` (or raises its error),
    `cancel()` ends it early and frees what it holds."""

    def __init__(self, service, run_id: str) -> None:
        self.service, self.run_id = service, run_id
        self._ended = threading.Event()
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._callbacks: list = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._ended.is_set()

    def result(self, timeout: float | None = None) -> RunResult:
        """The run's result; raises the run's error, or TimeoutError if `timeout` seconds pass first
        (the run goes on: cancel it to stop it)."""
        if not self._ended.wait(timeout):
            raise TimeoutError(f"run {self.run_id} has not ended within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """End the run now (a no-op once it has ended); `result()` then raises RunCancelledError."""
        self.service._inbox.put(("cancel", self.run_id))

    def add_done_callback(self, fn) -> None:
        """Call `fn(self)` once the run has ended (now, if it has): an event loop can await a run
        without a thread blocked in `result()`. `fn` runs on the thread that ends the run: keep it short."""
        with self._lock:
            if not self._ended.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _end(self, result: RunResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        with self._lock:
            self._ended.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
