"""Running workflows on a cluster: `af.run(workflow, cluster, strategy=...)` and `af.start`."""

from __future__ import annotations

from aaflow.common.errors import InvalidArgumentError, WorkflowError
from aaflow.runtime.results import RunResult
from aaflow.runtime.run_options import check_prefix_fetch
from aaflow.common.strategies import STRATEGIES
from aaflow.workflow.graph import Workflow
from aaflow.cluster.remote_runs import RemoteRunHandle
from aaflow.cluster.run_start import start_here


def run(workflow, cluster, strategy: str = "auto", on_token=None, on_agent=None, **options) -> RunResult:
    """Run `workflow` on `cluster` and wait for it; returns each agent's text, tokens and metrics.
    The arguments are `start`'s; an interrupted wait (Ctrl-C) cancels the run, freeing its KV."""
    handle = start(workflow, cluster, strategy, on_token=on_token, on_agent=on_agent, **options)
    try:
        return handle.result()
    except BaseException:
        handle.cancel()
        raise


def start(workflow, cluster, strategy: str = "auto", chunk_tokens: int = 16, call_timeout_s: float = 300.0,
          transport: str | None = None, plan=None, lend_cores: bool = True, on_token=None, on_agent=None,
          timeout_s: float | None = None, keep_prefix_s: float | None = None, prefix_fetch: str = "auto"):
    """Hand `workflow` to the scheduling loop of `cluster` and return its `RunHandle` at once
    (`result()` waits for the `RunResult`, `cancel()` ends it and frees its KV).

    Every run on a cluster, from any thread (or, on a deployment from `af.connect`, from any
    process), goes to the cluster's one scheduling loop (`aaflow.runtime.service`; a deployment's
    lives in a detached Ray actor, `aaflow.cluster.scheduler_actor`): the agents of concurrent runs are
    admitted, packed and decoded together on the replicas.

    Args:
        strategy: "auto" (the planner picks per agent, see `af.plan`), "text" (the baseline: text
            passing, prefix cache on, as on a serving engine), "text-nocache" (no KV reuse at all;
            papers' baseline), "recompute", "transfer", "stream" or "transfer+stream" (a per-agent
            `strategy=` in the DSL overrides it).
        chunk_tokens: streamed upstream tokens are prefilled downstream in chunks of at least this many.
        call_timeout_s: the longest any replica call may take before the run fails (nothing hangs).
        transport: KV transport between replicas ("ray", "nixl", "ucx", or an emulated link such as
            "ray@10Gbps"); default: the best available here that every replica takes
            (`aaflow.cluster.replica_api.default_transport`, the default of `af.transfer` too).
        plan: a `Plan` from `af.plan` to follow under "auto" (default: plan now, or reuse the plan
            this process made for the same prompts, cluster and profile; this machine's profile is
            calibrated on first use). If planning fails, auto falls back to its
            documented rule and says so in `events`.
        lend_cores: a long prefill sent while the other built-in replicas of its node idle runs
            on their threads too (`aaflow.runtime.core_lending`; each loan is in `events`).
        on_token: called as `on_token(agent, token_id)` for each token as it is decoded (streaming).
        on_agent: called as `on_agent(agent, text)` as each agent finishes.
        timeout_s: end the run (freeing its KV) with `RunCancelledError` once it has run this long.
        keep_prefix_s: keep the shared prefixes its agents forked this long after it ends (a later
            run reading one forks it rather than computing it; the HTTP endpoint's `ttl_s` hint).
        prefix_fetch: how a replica that lacks a shared prefix gets it: "auto" (the cost model
            chooses between moving its KV from a replica that holds it and computing it there, for
            the agents the planner placed), "move" or "compute" (always).

    Callbacks run on the loop's thread (on a deployment: on a thread of this process): keep them short.
    """
    _check_arguments(workflow, cluster, strategy)
    finite = isinstance(keep_prefix_s, (int, float)) and 0 <= keep_prefix_s < float("inf")
    if keep_prefix_s is not None and not finite:
        raise InvalidArgumentError(f"keep_prefix_s must be a finite number of seconds >= 0, got {keep_prefix_s!r}")
    check_prefix_fetch(prefix_fetch)
    options = dict(chunk_tokens=chunk_tokens, call_timeout_s=call_timeout_s, transport=transport, plan=plan,
                   lend_cores=lend_cores, timeout_s=timeout_s, keep_prefix_s=keep_prefix_s,
                   prefix_fetch=prefix_fetch)
    remote = getattr(cluster, "scheduler", None)
    if remote is not None:  # a deployment's loop, in its actor
        return RemoteRunHandle.start(remote, workflow, strategy, on_token, on_agent, options)
    return start_here(workflow, cluster, strategy, on_token=on_token, on_agent=on_agent, **options)


def _check_arguments(workflow, cluster, strategy) -> None:
    """A workflow, a cluster and a known strategy, or a typed error naming the one that is not."""
    if not isinstance(workflow, Workflow):
        raise InvalidArgumentError(f"the workflow must be an af.Workflow (or af.load_workflow(path)), "
                                   f"got {type(workflow).__name__}")
    if not (hasattr(cluster, "replicas") and hasattr(cluster, "models")):
        raise InvalidArgumentError(f"the cluster must be one af.init, af.up or af.connect returned, "
                                   f"got {type(cluster).__name__}")
    if strategy not in STRATEGIES:
        raise WorkflowError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
