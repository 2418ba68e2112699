"""`Cluster`: model replicas as Ray actors, placed with a placement group, on a local or joined Ray."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from aaflow.engine import decode_kernel
from aaflow.engine.dtypes import resolve_dtype
from aaflow.engine.kv_budget import default_kv_cache_bytes
from aaflow.engines_vllm import check_vllm
from aaflow.common.errors import AAFlowError
from aaflow.cluster.actors import replica_actors_made, start_ray
from aaflow.cluster.observed import observed
from aaflow.cluster.replica_api import REPLICAS, replica_class
from aaflow.runtime.probe_calls import InfoCall

_LIVE_CLUSTERS: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


class ClusterError(AAFlowError, RuntimeError):
    """The cluster could not be started, placed or reached (a replica died, or it was shut down)."""


@dataclass(frozen=True)
class ReplicaHandle:
    """One replica: its name, the model it serves and its Ray actor."""

    name: str
    model: str
    actor: Any
    engine: str = "builtin"  # or "vllm"
    cpus: float = 1.0  # the CPU share reserved for it

    def __repr__(self) -> str:
        return f"ReplicaHandle({self.name!r}, model={self.model!r}, engine={self.engine!r})"


ENGINES = tuple(REPLICAS)
DEPLOYMENT_NAMESPACE = "aaflow"  # the Ray namespace of a long-lived deployment's named actors (`aaflow up`)


def engine_per_model(replicas: dict[str, int], engine: str = "builtin", engines: dict[str, str] | None = None) -> dict[str, str]:
    """{model: "builtin" | "vllm"}: `engines[model]`, else `engine`. With any "vllm", checks that
    vLLM can be imported (raises `VLLMUnavailableError` naming the fix) before anything starts."""
    engines = dict(engines or {})
    unknown = sorted(set(engines) - set(replicas))
    if unknown:
        raise ValueError(f"engines names models without replicas: {unknown}")
    kinds = {model: engines.get(model, engine) for model in replicas}
    bad = {m: k for m, k in kinds.items() if k not in ENGINES}
    if bad:
        raise ValueError(f"unknown engine(s) {bad}; choose one of {ENGINES}")
    if "vllm" in kinds.values():
        check_vllm()
    return kinds


class Cluster:
    """Replicas of one or more models on Ray. Build it with `af.init`; end it with `shutdown()`.

    Replicas are reserved with a placement group (`placement_strategy` "PACK" or "SPREAD" across
    nodes) and get an equal share of the CPUs; each runs its engine with that many torch threads.
    `engine="vllm"` (every model) or `engines={model: "vllm"}` runs those replicas on vLLM
    (`aaflow.cluster.vllm_replica.VLLMReplica`, options in `vllm_options`); engine keyword arguments go
    to built-in replicas only. vLLM wants a core of its own: give it one CPU share per replica.
    `dtype="auto"` is resolved once, here, so that every built-in replica holds the same KV format
    (bf16 where this CPU has native bf16, else fp32: `aaflow.engine.dtypes`); vLLM replicas get bf16.
    `detached=True` (what `aaflow up` uses) names the replica actors `replica:<name>` in the Ray
    namespace `aaflow` and lets them and their placement group outlive this process.
    `actor_env` is added to the replicas' environment where Ray is joined here (`aaflow.cluster.actors.
    start_ray`: UCX and gloo on loopback where Ray is local), e.g. `{"UCX_NET_DEVICES": "eth1",
    "UCX_TLS": "tcp"}` for NIXL/UCX across hosts.
    """

    def __init__(self, replicas: dict[str, int], address: str | None = None, dtype: str = "auto",
                 num_cpus: int | None = None, placement_timeout_s: float = 60.0, load_timeout_s: float = 300.0,
                 placement_strategy: str = "PACK", engine: str = "builtin", engines: dict[str, str] | None = None,
                 vllm_options: dict | None = None, restarts: int = 0, detached: bool = False,
                 actor_env: dict[str, str] | None = None, **engine_kwargs) -> None:
        if not replicas or any(not isinstance(n, int) or n < 1 for n in replicas.values()):
            raise ValueError(f"replicas must map model names to counts >= 1, got {replicas!r}")
        kinds = engine_per_model(replicas, engine, engines)  # before Ray starts: vLLM missing fails here
        dtypes = {"builtin": resolve_dtype(dtype), "vllm": "bfloat16" if dtype == "auto" else dtype}
        if address is None and dtypes["builtin"] == "bfloat16" and "builtin" in kinds.values():
            decode_kernel.load()  # built here, where its progress line shows; replicas load it
        self._pg, self._attached, self.restarts = None, False, restarts
        self._owns_ray = not ray.is_initialized() and address is None
        start_ray(address=address, num_cpus=num_cpus, actor_env=actor_env)
        lifetime = {"lifetime": "detached"} if detached else {}
        total = sum(replicas.values())
        cpus = float(ray.available_resources().get("CPU", 1))
        per_replica = max(0.01, min(1.0, cpus / total))
        self._pg = placement_group([{"CPU": per_replica}] * total, strategy=placement_strategy, **lifetime)
        ready, _ = ray.wait([self._pg.ready()], timeout=placement_timeout_s)
        if not ready:
            remove_placement_group(self._pg)
            raise ClusterError(
                f"could not place {total} replicas ({per_replica:.2f} CPU each) within {placement_timeout_s:.0f} s; "
                "check `ray status` for free CPUs and that every node joined"
            )
        threads = max(1, int((num_cpus or os.cpu_count() or 1) // total))
        if "kv_cache_bytes" not in engine_kwargs and "num_blocks" not in engine_kwargs:
            builtin = sum(n for m, n in replicas.items() if kinds[m] == "builtin")
            engine_kwargs["kv_cache_bytes"] = default_kv_cache_bytes(builtin)  # as if they shared this machine
        actor_cls = {kind: ray.remote(observed(replica_class(kind))) for kind in set(kinds.values())}
        self._replicas: list[ReplicaHandle] = []
        self._closed = False
        index = 0
        for model, count in replicas.items():
            for i in range(count):
                name = f"{model}-{i}"
                kwargs = engine_kwargs if kinds[model] == "builtin" else dict(vllm_options or {})
                named = {"name": f"replica:{name}", "namespace": DEPLOYMENT_NAMESPACE, **lifetime} if detached else {}
                actor = actor_cls[kinds[model]].options(
                    num_cpus=per_replica, max_concurrency=1, max_restarts=restarts, **named,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=index),
                ).remote(name, model, dtype=dtypes[kinds[model]], threads=threads, **kwargs)
                self._replicas.append(ReplicaHandle(name, model, actor, kinds[model], per_replica))
                index += 1
        infos = [r.actor.run.remote(InfoCall()) for r in self._replicas]
        ready, pending = ray.wait(infos, num_returns=len(infos), timeout=load_timeout_s)
        if pending:
            self.shutdown()
            raise ClusterError(f"{len(pending)} replicas did not load their model within {load_timeout_s:.0f} s")
        try:
            self.info = {r.name: ray.get(ref) for r, ref in zip(self._replicas, infos)}
        except Exception as exc:
            self.shutdown()
            raise ClusterError(f"a replica failed to start: {exc}") from exc
        _LIVE_CLUSTERS.add(self)

    @classmethod
    def attach(cls, handles: list[ReplicaHandle], info: dict, owns_ray: bool = False, placement=None) -> "Cluster":
        """The cluster object of replicas that already run (a deployment's: see `af.connect`).
        Its `shutdown()` only disconnects (Ray too, when `owns_ray`); `terminate()` stops them."""
        self = cls.__new__(cls)
        self._replicas, self.info, self._pg = list(handles), dict(info), placement
        self._owns_ray, self._attached, self._closed = owns_ray, True, False
        self.scheduler = None  # a deployment's scheduling loop (a Ray actor): `af.connect` sets it
        self.restarts = 0  # a deployment's replicas are not restarted by Ray
        return self

    def replicas(self, model: str | None = None) -> list[ReplicaHandle]:
        """Replica handles, all or those serving `model`."""
        if self._closed:
            raise ClusterError("this cluster was shut down; start another with af.init")
        return [r for r in self._replicas if model is None or r.model == model]

    @property
    def placement(self):
        """The placement group reserving the replicas' CPUs (None once shut down)."""
        return self._pg

    @property
    def models(self) -> set[str]:
        return {r.model for r in self._replicas}

    def shutdown(self) -> None:
        """Stop the replicas and, if `af.init` started Ray, Ray itself. A cluster from `af.connect`
        only disconnects: the deployment's replicas keep running for other clients."""
        for service in self.__dict__.pop("_run_services", {}).values():  # the runs' scheduling loops
            service.stop()
        if not self._attached:
            self.terminate()
        self._replicas, self._closed = [], True
        if self._owns_ray:
            ray.shutdown()

    def terminate(self) -> None:
        """Stop the replicas and release their placement group, started here or attached to
        (`aaflow down`); Ray keeps running."""
        for r in self._replicas:
            try:
                ray.get(r.actor.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead replica needs no closing
                pass
            ray.kill(r.actor)
        self._replicas = []
        self._closed = True
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def live_clusters() -> list[Cluster]:
    """Clusters of this process that are not shut down (a leak check's view)."""
    return [c for c in list(_LIVE_CLUSTERS) if not c._closed]


def live_replica_actors() -> list:
    """Replica actors this process created that are still referenced: those `replica_actor` made and
    those of clusters not shut down (dead ones included: callers skip what no longer answers)."""
    return replica_actors_made() + [r.actor for c in live_clusters() for r in c._replicas]


def init(replicas: dict[str, int], address: str | None = None, **kwargs) -> Cluster:
    """Start (or join, with `address`) a Ray cluster and load `replicas` = {model: count}.

    Local Ray binds 127.0.0.1 only. Keyword arguments go to `Cluster` (dtype, num_cpus,
    placement_timeout_s, engine="vllm" or engines={model: "vllm"}, vllm_options, restarts, actor_env, and
    built-in engine settings such as kv_cache_bytes: each built-in replica's KV pool, by default 10%
    of this machine's memory shared by the built-in replicas, or $AAFLOW_KV_CACHE_BYTES;
    `aaflow.engine.kv_budget`).

    restarts: how many times Ray restarts a replica whose process dies (-1: always; default 0). A
    restarted replica comes back empty (its model reloaded, no KV); a run in flight recomputes what
    it held elsewhere, and later runs use it again.
    """
    return Cluster(replicas, address=address, **kwargs)
