"""The outcome of a replica call, read the same way by `af.*` (`cluster.remote`) and by the
scheduler's Ray backend (`cluster.ray_backend`): one error mapping for both."""

from __future__ import annotations

from aaflow.errors import AAFlowError
from aaflow.runtime.backend import ReplicaLostError


def call_result(ref, replica: str, timeout_s: float | None = None):
    """The value of a replica call's ObjectRef. An aaflow error or a `ValueError` about an argument
    raised in the replica comes back as itself, not wrapped in Ray's `RayTaskError`; a replica
    that died raises `ReplicaLostError` naming it; anything else raises as Ray reports it."""
    import ray

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
