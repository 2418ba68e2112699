"""A deployment's one scheduling loop, in a detached Ray actor that clients in any process reach.

`aaflow up` starts `SchedulerActor` (named `scheduler`, Ray namespace `aaflow`) next to the
replicas; it holds the deployment's `RunService`, so the runs of every client (`af.run` on a
cluster from `af.connect`, `af.submit`, `aaflow submit`, Ray jobs) are admitted, packed and decoded
together. A client calls `start` (the run is checked and planned in the actor, off the loop's
thread) and then `poll`s: each poll answers the tokens and finished agents since the last one, and
finally the `RunResult` or the error. A run whose client stops polling for `LEASE_S` (it died) is
cancelled and its KV freed.
"""

from __future__ import annotations

import threading
import time

from aaflow.errors import AAFlowError
from aaflow.runtime.run_handle import RunHandle

ACTOR_NAME = "scheduler"
LEASE_S = 30.0  # a run not polled for this long is cancelled: its client is gone
POLL_WAIT_S = 0.5  # how long a poll waits for news
QUIET_POLL_WAIT_S = 5.0  # the same for a client that follows no tokens (only the end; well inside LEASE_S)


class _Stream:
    """What a run produced that its client has not fetched yet."""

    def __init__(self) -> None:
        self.handle, self.items, self.polled = None, [], time.monotonic()
        self.news = threading.Condition()

    def put(self, item: tuple) -> None:
        with self.news:
            self.items.append(item)
            self.news.notify_all()


class SchedulerActor:
    """The deployment's scheduling loop (run it as a threaded Ray actor)."""

    def __init__(self, replicas: list, info: dict) -> None:
        from cluster.cluster import Cluster

        self.cluster = Cluster.attach(replicas, info)
        self.streams: dict[str, _Stream] = {}
        self.lock = threading.Lock()
        self.planning = threading.Lock()
        threading.Thread(target=self._expire, daemon=True, name="aaflow-leases").start()

    def ready(self) -> bool:
        return True

    def start(self, workflow, strategy: str, options: dict, follow: bool = True) -> str:
        """Check, plan and hand a run to the loop; answers its id. `follow`: its tokens and finished
        agents are kept for `poll` (a client without callbacks gets only the end: every poll costs
        CPU in this process, which the scheduling loop shares)."""
        from aaflow.runtime import start_here

        stream = _Stream()
        callbacks = dict(on_token=lambda a, t: stream.put(("token", a, t)),
                         on_agent=lambda a, text: stream.put(("agent", a, text))) if follow else {}
        with self.planning:  # one run checked and planned at a time (the planner and tokenizers are shared)
            stream.handle = start_here(workflow, self.cluster, strategy, **options, **callbacks)
        handle = stream.handle
        with self.lock:
            self.streams[handle.run_id] = stream
        handle.add_done_callback(lambda _: stream.put(("end",)))
        return handle.run_id

    def poll(self, run_id: str, wait_s: float = POLL_WAIT_S) -> tuple[list, bool, object]:
        """(items since the last poll, ended, RunResult or the error once ended)."""
        stream = self.streams.get(run_id)
        if stream is None:
            raise AAFlowError(f"no run {run_id!r} on this deployment (it ended and was fetched, or its client "
                              f"stopped polling for {LEASE_S:g} s and it was cancelled)")
        with stream.news:
            stream.polled = time.monotonic()
            if not stream.items and not stream.handle.done():
                stream.news.wait(wait_s)
            items, stream.items = stream.items, []
        if not stream.handle.done() or items and items[-1][0] != "end":
            return items, False, None
        with self.lock:
            self.streams.pop(run_id, None)
        try:
            return items, True, stream.handle.result()
        except BaseException as exc:  # noqa: BLE001 - handed to the client, who raises it
            return items, True, exc

    def cancel(self, run_id: str) -> None:
        stream = self.streams.get(run_id)
        if stream is not None:
            stream.handle.cancel()

    def _expire(self) -> None:
        while True:
            time.sleep(LEASE_S / 4)
            now = time.monotonic()
            with self.lock:
                lost = [s for s in self.streams.values() if now - s.polled > LEASE_S]
            for stream in lost:
                stream.handle.cancel()
                with self.lock:
                    self.streams.pop(stream.handle.run_id, None)


def start_scheduler(replicas: list, info: dict):
    """Start the deployment's detached scheduler actor and wait until it serves."""
    import ray

    from cluster.cluster import DEPLOYMENT_NAMESPACE

    actor = ray.remote(SchedulerActor).options(name=ACTOR_NAME, namespace=DEPLOYMENT_NAMESPACE, lifetime="detached",
                                               num_cpus=0, max_concurrency=256).remote(replicas, info)
    ray.get(actor.ready.remote())
    return actor


def find_scheduler():
    """The deployment's scheduler actor, or None (a deployment started before there was one)."""
    import ray

    from cluster.cluster import DEPLOYMENT_NAMESPACE

    try:
        return ray.get_actor(ACTOR_NAME, namespace=DEPLOYMENT_NAMESPACE)
    except ValueError:
        return None


class RemoteRunHandle(RunHandle):
    """A run on a deployment's scheduler actor, as a `RunHandle`: a thread of this process polls
    it, calling `on_token` / `on_agent` here as the tokens arrive."""

    def __init__(self, actor, run_id: str, on_token, on_agent, called: float) -> None:
        super().__init__(None, run_id)
        self.actor, self.called = actor, called
        self.on_token, self.on_agent = on_token, on_agent
        self.wait_s = POLL_WAIT_S if _follows(on_token, on_agent) else QUIET_POLL_WAIT_S
        threading.Thread(target=self._follow, daemon=True, name=f"aaflow-run-{run_id}").start()

    @classmethod
    def start(cls, actor, workflow, strategy: str, on_token, on_agent, options: dict) -> "RemoteRunHandle":
        import ray

        called = time.perf_counter()
        run_id = ray.get(actor.start.remote(workflow, strategy, options, _follows(on_token, on_agent)))
        return cls(actor, run_id, on_token, on_agent, called)

    def cancel(self) -> None:
        if not self.done():
            self.actor.cancel.remote(self.run_id)

    def _follow(self) -> None:
        import ray

        try:
            while True:
                items, ended, outcome = ray.get(self.actor.poll.remote(self.run_id, self.wait_s))
                for item in items:
                    if item[0] == "token" and self.on_token is not None:
                        self.on_token(item[1], item[2])
                    elif item[0] == "agent" and self.on_agent is not None:
                        self.on_agent(item[1], item[2])
                if ended:
                    break
        except BaseException as exc:  # noqa: BLE001 - the deployment went away, or a callback raised
            self.cancel()
            self._end(None, exc)
            return
        if isinstance(outcome, BaseException):
            self._end(None, outcome)
        else:
            outcome.total_s = time.perf_counter() - self.called
            self._end(outcome, None)


def _follows(on_token, on_agent) -> bool:
    """A client with callbacks follows its run's tokens and agents; one without waits for the end."""
    return on_token is not None or on_agent is not None
