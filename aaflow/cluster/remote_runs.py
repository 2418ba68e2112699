"""Runs on a deployment's scheduler actor, as a client process holds them.

`RemoteRunHandle` is a `RunHandle` for a run that `aaflow.cluster.scheduler_actor.SchedulerActor` runs.
All runs a process has on one deployment are followed by one thread (`_Follower`) with one `poll`
at a time, which answers the news of every run at once, and it calls each run's `on_token` /
`on_agent` here as the tokens arrive. The follower thread ends when the process has no run left
there, and a new run starts it again.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import ray

from aaflow.runtime.run_handle import RunHandle
from aaflow.cluster.scheduler_actor import POLL_WAIT_S

_ids: dict[int, str] = {}


def client_id() -> str:
    """This process, to the scheduler actor (a forked child is a client of its own)."""
    return _ids.setdefault(os.getpid(), f"{os.getpid()}-{uuid.uuid4().hex}")


class RemoteRunHandle(RunHandle):
    """A run on a deployment's scheduler actor, as a `RunHandle`."""

    def __init__(self, actor, run_id: str, on_token, on_agent, called: float) -> None:
        super().__init__(None, run_id)
        self.actor, self.called = actor, called
        self.on_token, self.on_agent = on_token, on_agent

    @classmethod
    def start(cls, actor, workflow, strategy: str, on_token, on_agent, options: dict) -> "RemoteRunHandle":
        called = time.perf_counter()
        follow = on_token is not None or on_agent is not None  # a client without callbacks waits for the end
        run_id = ray.get(actor.start.remote(client_id(), workflow, strategy, options, follow))
        handle = cls(actor, run_id, on_token, on_agent, called)
        _Follower.of(actor).add(handle)
        return handle

    def cancel(self) -> None:
        if not self.done():
            self.actor.cancel.remote(self.run_id)

    def _take(self, items: list, ended: bool, outcome) -> None:
        """News from a poll: calls the callbacks; ends the run with its outcome."""
        for item in items:
            if item[0] == "token" and self.on_token is not None:
                self.on_token(item[1], item[2])
            elif item[0] == "agent" and self.on_agent is not None:
                self.on_agent(item[1], item[2])
        if not ended:
            return
        if isinstance(outcome, BaseException):
            self._end(None, outcome)
        else:
            outcome.total_s = time.perf_counter() - self.called
            self._end(outcome, None)


class _Follower:
    """The one thread of this process that polls a scheduler actor for all of this process's runs."""

    _by_actor: dict = {}
    _made = threading.Lock()

    def __init__(self, actor) -> None:
        self.actor = actor
        self.runs: dict[str, RemoteRunHandle] = {}
        self.early: dict[str, list] = {}  # news for a run polled before its handle was added
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    @classmethod
    def of(cls, actor) -> "_Follower":
        key = (os.getpid(), actor._actor_id.hex())  # a forked child has no follower thread
        with cls._made:
            return cls._by_actor.setdefault(key, cls(actor))

    def add(self, handle: RemoteRunHandle) -> None:
        with self.lock:
            self.runs[handle.run_id] = handle
            early = self.early.pop(handle.run_id, [])
            if self.thread is None:
                self.thread = threading.Thread(target=self._follow, daemon=True, name="aaflow-follower")
                self.thread.start()
        for news in early:
            self._hand(handle, *news)

    def _follow(self) -> None:
        while True:
            try:
                answers = ray.get(self.actor.poll.remote(client_id(), POLL_WAIT_S))
            except BaseException as exc:  # noqa: BLE001 - the deployment went away: every run here ends with it
                self._end_all(exc)
                return
            for run_id, news in answers.items():
                with self.lock:
                    handle = self.runs.get(run_id)
                    if handle is None:
                        self.early.setdefault(run_id, []).append(news)
                        continue
                self._hand(handle, *news)
            with self.lock:
                if not self.runs:
                    self.thread = None
                    return

    def _hand(self, handle: RemoteRunHandle, items: list, ended: bool, outcome) -> None:
        if ended:
            with self.lock:
                self.runs.pop(handle.run_id, None)
        try:
            handle._take(items, ended, outcome)
        except BaseException as exc:  # noqa: BLE001 - a callback raised: that run ends with its error
            with self.lock:
                self.runs.pop(handle.run_id, None)
            handle.cancel()
            handle._end(None, exc)

    def _end_all(self, exc: BaseException) -> None:
        with self.lock:
            runs, self.runs, self.thread = list(self.runs.values()), {}, None
        for handle in runs:
            handle._end(None, exc)
