"""A deployment that outlives its clients: `aaflow up` / `af.up`, `af.connect`, `af.status`, `af.down`.

`up` starts detached, named replica actors (`replica:<name>`, Ray namespace `aaflow`) in a detached
placement group on an existing Ray cluster, and a detached `DeploymentRecord` actor (`deployment`)
that remembers them: their handles, models, engines, CPU shares and load info. Any process that
reaches the cluster then gets the same `Cluster` object `af.init` returns with `af.connect`, and
`af.run` / `af.submit` / `af.materialize` / `af.pin` work on it unchanged.

The deployment has one scheduling loop, in a detached actor (`scheduler`, `aaflow.cluster.scheduler_actor`):
`af.run` / `af.submit` from any client hand it their workflow and follow the run's tokens, so
the runs of every client are admitted, packed and decoded together on the shared replicas, which
also share their prefix cache and pinned contexts. A client that dies stops polling; its run is
cancelled and its KV freed.
"""

from __future__ import annotations

import os
import socket
import time

import ray

from aaflow.common.errors import DeploymentError, InvalidArgumentError
from aaflow.cluster.actors import start_ray
from aaflow.cluster.cluster import DEPLOYMENT_NAMESPACE, Cluster, ReplicaHandle
from aaflow.cluster.ray_auth import auth_hint, enable_here
from aaflow.cluster.scheduler_actor import LEASE_S, find_scheduler, start_scheduler

RECORD_NAME = "deployment"


class DeploymentRecord:
    """What a deployment is, kept by a detached actor: replica handles, their info, the placement group."""

    def __init__(self) -> None:
        self.replicas: list[ReplicaHandle] = []
        self.info: dict = {}
        self.placement = None

    def set(self, replicas: list[ReplicaHandle], info: dict, placement) -> None:
        self.replicas, self.info, self.placement = list(replicas), dict(info), placement

    def get(self) -> dict:
        return {"replicas": self.replicas, "info": self.info, "placement": self.placement}


def _address(address: str | None) -> str:
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise DeploymentError("no Ray address: pass address= (the `ray start --head` address, e.g. 127.0.0.1:6379, "
                              "or --address on the command line) or set RAY_ADDRESS")
    return address


def _check_listening(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast where nothing listens at a "host:port" address (Ray would retry for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and the like: Ray resolves them
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise DeploymentError(f"nothing answers at {address} ({exc}); start a Ray cluster with `ray start --head "
                              "--node-ip-address=127.0.0.1` and pass the address it prints") from None


def _join(address: str | None, actor_env: dict[str, str] | None = None) -> tuple[str, bool]:
    """Join the Ray cluster at `address` (or RAY_ADDRESS), the actors started from here with
    `actor_env` (`start_ray`); returns it and whether this call started Ray here."""
    address = _address(address)
    _check_listening(address)
    owns = not ray.is_initialized()
    if owns:
        enable_here()  # a head started where a token exists wants it (aaflow/cluster/ray_auth.py)
    try:
        start_ray(address=address, actor_env=actor_env)
    except (ConnectionError, RuntimeError) as exc:
        raise DeploymentError(f"cannot reach a Ray cluster at {address}: {exc}{auth_hint(exc)}; start one with "
                              f"`ray start --head --node-ip-address=127.0.0.1` and pass its address") from exc
    return address, owns


def _record(address: str | None):
    """Join the cluster and read its deployment: (record actor, its state, whether Ray started here).
    Raises `DeploymentError` (leaving Ray as it found it) when there is none."""
    address, owns = _join(address)
    try:
        record = ray.get_actor(RECORD_NAME, namespace=DEPLOYMENT_NAMESPACE)
    except ValueError:
        if owns:
            ray.shutdown()
        raise DeploymentError(f"no aaflow deployment on the Ray cluster at {address}; start one with "
                              f"`aaflow up --address {address} --replicas MODEL=N`") from None
    return record, ray.get(record.get.remote()), owns


def up(replicas: dict[str, int], address: str | None = None, client_lease_s: float = LEASE_S, **kwargs) -> Cluster:
    """Start a deployment on the Ray cluster at `address` (or RAY_ADDRESS): `replicas` =
    {model: count}, detached, plus the record that `af.connect` reads. A client process not heard
    from for `client_lease_s` seconds is gone: its runs are cancelled and their KV freed. Keyword
    arguments go to `Cluster` (dtype, engine / engines, kv_cache_bytes, ...). Returns the
    deployment's cluster; its `shutdown()` disconnects, `af.down` removes it. Raises
    `DeploymentError` if one already runs, `InvalidArgumentError` for a lease that is not a
    positive number of seconds."""
    if not (isinstance(client_lease_s, (int, float)) and 0 < client_lease_s < float("inf")):
        raise InvalidArgumentError(f"client_lease_s must be a positive number of seconds, got {client_lease_s!r}")

    address, owns = _join(address, kwargs.get("actor_env"))
    try:
        record = ray.remote(DeploymentRecord).options(
            name=RECORD_NAME, namespace=DEPLOYMENT_NAMESPACE, lifetime="detached", num_cpus=0).remote()
        ray.get(record.get.remote())
    except ValueError:
        if owns:
            ray.shutdown()
        raise DeploymentError(f"an aaflow deployment already runs on {address}: see `aaflow status --address "
                              f"{address}`, or remove it with `aaflow down --address {address}` first") from None
    try:
        cluster = Cluster(replicas, address=address, detached=True, **kwargs)
    except BaseException:
        ray.kill(record)
        if owns:
            ray.shutdown()
        raise
    try:
        scheduler = start_scheduler(cluster.replicas(), cluster.info, client_lease_s)
    except BaseException:
        cluster.terminate()
        ray.kill(record)
        raise
    ray.get(record.set.remote(cluster.replicas(), cluster.info, cluster.placement))
    attached = Cluster.attach(cluster.replicas(), cluster.info, owns_ray=owns)
    attached.scheduler = scheduler
    return attached


def connect(address: str | None = None) -> Cluster:
    """The running deployment on the Ray cluster at `address` (or RAY_ADDRESS), as the `Cluster`
    object `af.init` returns. `shutdown()` on it disconnects; the deployment keeps running.
    Raises `DeploymentError` when the cluster cannot be reached or holds no deployment."""
    _, state, owns = _record(address)
    cluster = Cluster.attach(state["replicas"], state["info"], owns_ray=owns, placement=state["placement"])
    cluster.scheduler = find_scheduler()
    return cluster


def status(target: Cluster | str | None = None) -> list[dict]:
    """Per replica of a deployment (a connected cluster, or an address): name, model, engine,
    CPUs, node, KV bytes held / pinned / evictable, queue depth (sessions open), prefill tokens
    computed / reused, KV bytes received and busy seconds."""
    cluster = target if isinstance(target, Cluster) else connect(target)
    try:
        handles = cluster.replicas()
        rows = ray.get([r.actor.usage.remote() for r in handles], timeout=60)
        for r, row in zip(handles, rows):
            row.update(engine=r.engine, cpus=r.cpus, node=cluster.info.get(r.name, {}).get("node"),
                       threads=cluster.info.get(r.name, {}).get("threads"))
        return rows
    finally:
        if cluster is not target:
            cluster.shutdown()


def down(address: str | None = None) -> list[str]:
    """Stop the deployment on the Ray cluster at `address` (or RAY_ADDRESS): its replicas, their
    placement group and its record. Returns the names of the replicas stopped."""
    record, state, owns = _record(address)
    cluster = Cluster.attach(state["replicas"], state["info"], placement=state["placement"])
    names = [r.name for r in cluster.replicas()]
    scheduler = find_scheduler()
    if scheduler is not None:
        ray.kill(scheduler)
    cluster.terminate()
    ray.kill(record)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the name is released once the record is dead: `up` may follow at once
        try:
            ray.get_actor(RECORD_NAME, namespace=DEPLOYMENT_NAMESPACE)
        except ValueError:
            break
        time.sleep(0.2)
    if owns:
        ray.shutdown()
    return names
