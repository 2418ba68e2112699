"""The driver side of a replica call: submit it (a future), read its outcome. `af.*`
(`aaflow.cluster.remote`), the scheduler's Ray backend (`aaflow.cluster.ray_backend`) and calibration all read
outcomes here: one error mapping for all of them."""

from __future__ import annotations

import ray

from aaflow.common.errors import AAFlowError
from aaflow.runtime.backend import ReplicaLostError
from aaflow.runtime.calls import Call
from aaflow.cluster.cluster import ClusterError


def call_result(ref, replica: str, timeout_s: float | None = None):
    """The value of a replica call's ObjectRef. An aaflow error or a `ValueError` about an argument
    raised in the replica comes back as itself, not wrapped in Ray's `RayTaskError`; a replica
    that died raises `ReplicaLostError` naming it; anything else raises as Ray reports it."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, AAFlowError):
            raise err.cause from None
        if isinstance(err.cause, ValueError):
            raise err.cause from err
        raise
    except ray.exceptions.RayActorError as err:
        raise ReplicaLostError(f"replica {replica} died or was stopped: the KV it held is lost") from err


class ReplicaFuture:
    """A replica call in flight (`submit`); `result()` waits for its value."""

    def __init__(self, replica, ref) -> None:
        self.replica, self.ref = replica, ref

    def result(self, timeout_s: float | None = None):
        """The call's value, errors as `call_result` maps them; a replica that died, or a cluster
        shut down meanwhile, raises `ClusterError`. Blocking; may be called once."""
        try:
            return call_result(self.ref, self.replica.name, timeout_s)
        except ReplicaLostError as err:
            raise ClusterError(f"{err}; materialize the context again on a live replica") from err


def submit(replica, call: Call) -> ReplicaFuture:
    """Start a typed call (`aaflow.runtime.calls`) on a replica (a `ReplicaHandle`) without waiting.
    Raises `ClusterError` when Ray is not running (the cluster was shut down)."""
    if not ray.is_initialized():
        raise ClusterError(f"replica {replica.name} is gone: Ray is not running (was the cluster shut down?); "
                           "start one with af.init and materialize the context again")
    return ReplicaFuture(replica, replica.actor.run.remote(call))


def call(replica, typed_call: Call):
    """`submit(...).result()`: run a typed call on a replica and wait for its answer (its `Reply`)."""
    return submit(replica, typed_call).result()
