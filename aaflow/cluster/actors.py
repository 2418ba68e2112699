"""Ray at the edge: start or join a Ray cluster on loopback and host `ModelReplica`s as actors."""

from __future__ import annotations

import os
import tempfile
import weakref
from pathlib import Path

import ray
from ray._private import ray_constants

from aaflow.cluster.replica import ModelReplica

ACTOR_ENV = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}  # every replica actor's
# UCX-based transports and gloo on loopback only, where Ray runs on this machine alone; on a cluster
# reached at another address they pick the hosts' interfaces (or `Cluster(actor_env=...)` names them)
LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def default_temp_dir() -> str:
    """Ray's session folder: short (Unix socket paths are limited to 107 bytes), under the user's tmp."""
    path = Path(tempfile.gettempdir()) / f"aaflow-ray-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def loopback_only() -> None:
    """Ray 2.60 replaces `_node_ip_address="127.0.0.1"` by the machine's routable address and its
    gRPC servers then listen on every interface, unless it believes it runs a single-machine
    cluster: then every Ray process binds 127.0.0.1 (checked with `ss -ltnp`)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # inherited by Ray's own processes
    ray_constants.ENABLE_RAY_CLUSTER = False  # read by ray.init in this process


def _is_loopback(address: str) -> bool:
    """Whether a "host:port" Ray address names this machine's loopback (127.x.x.x, localhost, ::1)."""
    host = address.rpartition(":")[0] if ":" in address else address
    host = host.strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def start_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None,
              actor_env: dict[str, str] | None = None):
    """Join `address`, or start a local Ray bound to 127.0.0.1 with no dashboard (nothing on 0.0.0.0).
    The actors get `ACTOR_ENV`, `LOOPBACK_ENV` too where Ray is local (no address, or a loopback
    one), and `actor_env` over both (e.g. UCX_NET_DEVICES of a real link); it has no effect where
    Ray already runs in this process."""
    if ray.is_initialized():
        return ray
    local = address is None or _is_loopback(address)
    env = {"env_vars": {**ACTOR_ENV, **(LOOPBACK_ENV if local else {}), **(actor_env or {})}}
    if address is not None:
        if _is_loopback(address):
            # Without this, Ray rewrites "127.0.0.1:port" to this machine's routable address and the
            # driver retries a GCS that only listens on 127.0.0.1, forever.
            loopback_only()
        ray.init(address=address, runtime_env=env, log_to_driver=False)
    else:
        loopback_only()
        ray.init(num_cpus=num_cpus or os.cpu_count(), _node_ip_address="127.0.0.1", include_dashboard=False,
                 _temp_dir=temp_dir or default_temp_dir(), runtime_env=env, log_to_driver=False)
    return ray


_REPLICA_ACTORS: "weakref.WeakSet" = weakref.WeakSet()  # replica actors this process made (leak checks)


def replica_actor(name: str, model: str, num_cpus: float = 1, **replica_kwargs):
    """Create a `ModelReplica` as a named Ray actor (its calls run one at a time)."""
    actor_cls = ray.remote(ModelReplica)
    actor = actor_cls.options(name=name, num_cpus=num_cpus, max_concurrency=1).remote(name, model, **replica_kwargs)
    _REPLICA_ACTORS.add(actor)
    return actor


def replica_actors_made() -> list:
    """The replica actors `replica_actor` made in this process that are still referenced."""
    return list(_REPLICA_ACTORS)
