"""The scheduler's backend on Ray: each call runs on its replica's actor.

This module and `aaflow/cluster/` are the only places that call `.remote` / `ray.wait` for the
scheduler (`aaflow.runtime.scheduler`, which drives replicas through `aaflow.runtime.backend`).
"""

from __future__ import annotations

import itertools
import threading
import time

import ray

from aaflow.cluster.planning import machine_prefix_costs
from aaflow.runtime.backend import Backend, ReplicaInfo, Ticket
from aaflow.runtime.calls import Call
from aaflow.runtime.probe_calls import InfoCall
from aaflow.runtime.service import RunService
from aaflow.cluster.replica_api import default_transport
from aaflow.cluster.replica_calls import call_result


class RayBackend(Backend):
    """Runs calls on the replica actors of a `Cluster`, timed by the wall clock."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.handles = {r.name: r for r in cluster.replicas()}
        self.start = time.perf_counter()
        self.refs: dict[Ticket, ray.ObjectRef] = {}
        self.pings: dict[str, ray.ObjectRef] = {}  # lost replica -> a call that answers once it is back
        self._seq = itertools.count()

    def replicas(self) -> list[ReplicaInfo]:
        info = self.cluster.info
        return [ReplicaInfo(r.name, r.model, r.engine, i.get("node"), i.get("threads", 1), i.get("kv_blocks"),
                            i.get("block_size", 16), i.get("prefix_caching", True))
                for r in self.handles.values() for i in [info.get(r.name, {})]]

    def default_transport(self) -> str:
        """The best transport every replica's engine takes (`aaflow.cluster.replica_api.default_transport`)."""
        return default_transport({r.engine for r in self.handles.values()})

    def prefix_costs(self):
        """This machine's calibrated costs for the cluster (`aaflow.cluster.planning.machine_prefix_costs`), or None."""
        return machine_prefix_costs(self.cluster)

    def now(self) -> float:
        return time.perf_counter() - self.start

    def submit(self, replica: str, call: Call) -> Ticket:
        ref = self.handles[replica].actor.run.remote(call)
        ticket = Ticket(next(self._seq), replica, call)
        self.refs[ticket] = ref
        return ticket

    def wait(self, tickets: list[Ticket], num_returns: int, timeout_s: float) -> list[Ticket]:
        if not tickets:
            return []
        by_ref = {self.refs[t]: t for t in tickets}
        ready, _ = ray.wait(list(by_ref), num_returns=num_returns, timeout=timeout_s)
        return [by_ref[ref] for ref in ready]

    def result(self, ticket: Ticket):
        return call_result(self.refs.pop(ticket), ticket.replica)

    def revived(self, replica: str, timeout_s: float) -> bool | None:
        """Ray restarts a replica's actor when the cluster allows restarts; a call submitted while
        it restarts runs once it is back, so an answered `info` call means it serves again."""
        if not self.cluster.restarts:
            return None
        ping = self.pings.get(replica)
        if ping is None:
            ping = self.pings[replica] = self.handles[replica].actor.run.remote(InfoCall())
        ready, _ = ray.wait([ping], timeout=timeout_s)
        if not ready:
            return False
        del self.pings[replica]
        try:
            ray.get(ping)
        except ray.exceptions.ActorDiedError:  # its restarts ran out
            return None
        except ray.exceptions.RayActorError:  # still down: ask again later (not at once)
            time.sleep(min(timeout_s, 0.2))
            return False
        return True


def service_for(cluster) -> RunService:
    """The scheduling loop of `cluster` (made on first use): one per cluster, whatever the options
    of the runs it serves (`RunOptions` travel with each run). `aaflow.cluster.shutdown()` stops it."""
    with _SERVICES_LOCK:
        services = cluster.__dict__.setdefault("_run_services", {})
        if "loop" not in services:
            services["loop"] = RunService(RayBackend(cluster))
        return services["loop"]


_SERVICES_LOCK = threading.Lock()
