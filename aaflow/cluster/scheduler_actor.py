"""A deployment's one scheduling loop, in a detached Ray actor that clients in any process reach.

`aaflow up` starts `SchedulerActor` (named `scheduler`, Ray namespace `aaflow`) next to the
replicas; it holds the deployment's `RunService`, so the runs of every client (`af.run` on a
cluster from `af.connect`, `af.submit`, `aaflow submit`, Ray jobs, `aaflow serve`) are admitted,
packed and decoded together. A client process calls `start` for each run (checked and planned in
the actor, off the loop's thread) and follows all its runs with one `poll` at a time
(`aaflow.cluster.remote_runs`): each poll answers, for every run of that client with news, the tokens and
finished agents since the last poll, and finally the `RunResult` or the error. One poll per client
process, not one per run, keeps the CPU this process spends on clients (which the scheduling loop
shares) flat as runs are added. The runs of a client that stops polling for `LEASE_S` (it died)
are cancelled and their KV freed.
"""

from __future__ import annotations

import threading
import time

import ray

from aaflow.cluster.cluster import DEPLOYMENT_NAMESPACE, Cluster
from aaflow.cluster.ray_backend import service_for
from aaflow.cluster.run_start import start_here

ACTOR_NAME = "scheduler"
LEASE_S = 30.0  # a client not heard from for this long is gone: its runs are cancelled
POLL_WAIT_S = 5.0  # how long a poll waits for news (well inside LEASE_S)
GATHER_S = 0.01  # once there is news, how long a poll waits for more (the other runs' tokens of one step)


class _Client:
    """One client process: its runs' streams and the news that wakes its poll."""

    def __init__(self) -> None:
        self.news = threading.Condition()
        self.streams: dict[str, _Stream] = {}
        self.polled = time.monotonic()


class _Stream:
    """What a run produced that its client has not fetched yet."""

    def __init__(self, client: _Client) -> None:
        self.client, self.handle, self.items = client, None, []

    def put(self, item: tuple) -> None:
        with self.client.news:
            self.items.append(item)
            self.client.news.notify_all()


class SchedulerActor:
    """The deployment's scheduling loop (run it as a threaded Ray actor)."""

    def __init__(self, replicas: list, info: dict, lease_s: float = LEASE_S) -> None:
        self.cluster = Cluster.attach(replicas, info)
        self.lease_s = lease_s
        self.clients: dict[str, _Client] = {}
        self.lock = threading.Lock()
        self.planning = threading.Lock()
        threading.Thread(target=self._expire, daemon=True, name="aaflow-leases").start()

    def ready(self) -> bool:
        return True

    def start(self, client_id: str, workflow, strategy: str, options: dict, follow: bool = True) -> str:
        """Check, plan and hand a run of client `client_id` to the loop; answers its id. `follow`: its
        tokens and finished agents are kept for `poll` (a client without callbacks gets only the
        end: every item costs CPU in this process, which the scheduling loop shares)."""
        with self.lock:
            client = self.clients.setdefault(client_id, _Client())
            client.polled = time.monotonic()
        stream = _Stream(client)
        callbacks = dict(on_token=lambda a, t: stream.put(("token", a, t)),
                         on_agent=lambda a, text: stream.put(("agent", a, text))) if follow else {}
        with self.planning:  # one run checked and planned at a time (the planner and tokenizers are shared)
            stream.handle = start_here(workflow, self.cluster, strategy, **options, **callbacks)
        with client.news:
            client.streams[stream.handle.run_id] = stream
            client.news.notify_all()  # what it produced while it started
        stream.handle.add_done_callback(lambda _: stream.put(("end",)))
        return stream.handle.run_id

    def poll(self, client_id: str, wait_s: float = POLL_WAIT_S) -> dict[str, tuple[list, bool, object]]:
        """Per run of the client with news: (items since the last poll, ended, the RunResult or the
        error once ended). Waits up to `wait_s` for news; ended runs are answered once, then forgotten."""
        with self.lock:
            client = self.clients.setdefault(client_id, _Client())
        with client.news:
            client.polled = time.monotonic()
            if not any(s.items for s in client.streams.values()):
                client.news.wait(min(wait_s, self.lease_s / 3))  # the client polls again well inside its lease
            news = any(s.items for s in client.streams.values())
        if news:  # a poll that waited out its time has nothing to gather
            time.sleep(GATHER_S)
        answers = {}
        with client.news:
            client.polled = time.monotonic()
            for run_id, stream in list(client.streams.items()):
                if not stream.items:
                    continue
                items, stream.items = stream.items, []
                if items[-1][0] == "end":
                    del client.streams[run_id]
                    answers[run_id] = (items, True, _outcome(stream.handle))
                else:
                    answers[run_id] = (items, False, None)
        return answers

    def prefix_decisions(self) -> dict[str, dict]:
        """How the loop's replicas got the shared prefixes they lacked, per kind: moves and
        computations, the cost model's predicted seconds against the measured ones."""
        return service_for(self.cluster).scheduler.prefix_decisions()

    def cancel(self, run_id: str) -> None:
        with self.lock:
            clients = list(self.clients.values())
        for client in clients:
            stream = client.streams.get(run_id)
            if stream is not None:
                stream.handle.cancel()

    def _expire(self) -> None:
        while True:
            time.sleep(self.lease_s / 4)
            now = time.monotonic()
            with self.lock:
                lost = [c for c in self.clients.values() if now - c.polled > self.lease_s]
                self.clients = {k: c for k, c in self.clients.items() if now - c.polled <= self.lease_s}
            for client in lost:
                for stream in list(client.streams.values()):
                    stream.handle.cancel()


def _outcome(handle):
    """An ended run's RunResult, or its error (handed to the client, who raises it)."""
    try:
        return handle.result()
    except BaseException as exc:  # noqa: BLE001
        return exc


def start_scheduler(replicas: list, info: dict, lease_s: float = LEASE_S):
    """Start the deployment's detached scheduler actor (clients' lease `lease_s`) and wait until it serves."""
    actor = ray.remote(SchedulerActor).options(name=ACTOR_NAME, namespace=DEPLOYMENT_NAMESPACE, lifetime="detached",
                                               num_cpus=0, max_concurrency=256).remote(replicas, info, lease_s)
    ray.get(actor.ready.remote())
    return actor


def find_scheduler():
    """The deployment's scheduler actor, or None (a deployment started before there was one)."""
    try:
        return ray.get_actor(ACTOR_NAME, namespace=DEPLOYMENT_NAMESPACE)
    except ValueError:
        return None
