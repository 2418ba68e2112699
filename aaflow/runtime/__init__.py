"""Running workflows on a cluster: `af.run(workflow, cluster, strategy=...)`."""

from __future__ import annotations

import functools
import threading
import time

from aaflow.errors import AAFlowError, InvalidArgumentError, WorkflowError
from aaflow.runtime.executor import workflow_agents
from aaflow.runtime.kvops import check_replicas
from aaflow.runtime.recovery import AgentFailedError
from aaflow.runtime.prompts import AgentInput, PromptBuilder
from aaflow.runtime.results import AgentResult, RunResult
from aaflow.runtime.service import RunCancelledError, RunHandle, service_for
from aaflow.strategies import STRATEGIES
from aaflow.workflow.graph import Workflow

__all__ = ["AgentFailedError", "AgentResult", "RunCancelledError", "RunHandle", "RunResult", "prompt_builders", "run",
           "start"]


def prompt_builders(models: set[str]) -> tuple[dict, dict, dict]:
    """Per model: a prompt builder (fresh: its tokenization memo lasts one run), its end-of-sequence
    token ids and its position limit."""
    builders, eos, limits = {}, {}, {}
    for model in models:
        with _LOADING:  # runs start from many threads; transformers' lazy imports are not thread-safe
            tokenizer, lock, eos[model], limits[model] = _model_text(model)
        builders[model] = PromptBuilder(tokenizer, lock)
    return builders, eos, limits


_LOADING = threading.Lock()


@functools.lru_cache(maxsize=16)
def _model_text(model: str) -> tuple[object, threading.Lock, set[int], int]:
    """A model's tokenizer (loaded once per process, like the replicas' weights: ~0.35 s each), the
    lock its callers share (runs from several threads use it), end-of-sequence ids and position limit."""
    from transformers import AutoTokenizer

    from aaflow.engine.config import ModelConfig
    from aaflow.models import resolve_model_path

    folder = resolve_model_path(model, quiet=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = ModelConfig.from_folder(folder)
    eos = set(config.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
    return tokenizer, threading.Lock(), eos, config.max_position_embeddings


def _check_sizes(wf, builders, limits, cluster=None) -> None:
    """Refuse prompts that cannot fit the model's positions, counting upstream outputs at their
    max, and (given a live cluster) prompts that no replica's KV pool could hold even alone."""
    pools: dict[str, int] = {}
    for r in cluster.replicas() if hasattr(cluster, "info") else []:
        info = cluster.info.get(r.name, {})
        if info.get("kv_blocks"):
            pools[r.model] = max(pools.get(r.model, 0), info["kv_blocks"] * info.get("block_size", 16))
    for agent in wf.agents():
        prompt = 0
        for seg in builders[agent.model].segments(wf, agent):
            prompt += wf.nodes[seg.agent].max_tokens if isinstance(seg, AgentInput) else len(seg)
        total = prompt + agent.max_tokens
        if total > limits[agent.model]:
            raise WorkflowError(
                f"agent {agent.name!r}: prompt plus output can reach {total} tokens, beyond model "
                f"{agent.model!r}'s {limits[agent.model]} positions; shorten its contexts or max_tokens"
            )
        if agent.model in pools and prompt + 1 > pools[agent.model]:
            raise WorkflowError(
                f"agent {agent.name!r}: its prompt can reach {prompt} tokens, more than the KV pool of any "
                f"replica of {agent.model!r} holds ({pools[agent.model]} tokens); start the cluster with a "
                "larger kv_cache_bytes (af.init, --kv-cache-bytes or AAFLOW_KV_CACHE_BYTES) or shorten it"
            )


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
          timeout_s: float | None = None, keep_prefix_s: float | None = None):
    """Hand `workflow` to the scheduling loop of `cluster` and return its `RunHandle` at once
    (`result()` waits for the `RunResult`, `cancel()` ends it and frees its KV).

    Every run on a cluster, from any thread (or, on a deployment from `af.connect`, from any
    process), goes to the cluster's one scheduling loop (`aaflow.runtime.service`; a deployment's
    lives in a detached Ray actor, `cluster.scheduler_actor`): the agents of concurrent runs are
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
            (`cluster.replica_api.default_transport`, the default of `af.transfer` too).
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

    Callbacks run on the loop's thread (on a deployment: on a thread of this process): keep them short.
    """
    _check_arguments(workflow, cluster, strategy)
    if keep_prefix_s is not None and not (isinstance(keep_prefix_s, (int, float)) and 0 <= keep_prefix_s < float("inf")):
        raise InvalidArgumentError(f"keep_prefix_s must be a finite number of seconds >= 0, got {keep_prefix_s!r}")
    options = dict(chunk_tokens=chunk_tokens, call_timeout_s=call_timeout_s, transport=transport, plan=plan,
                   lend_cores=lend_cores, timeout_s=timeout_s, keep_prefix_s=keep_prefix_s)
    remote = getattr(cluster, "scheduler", None)
    if remote is not None:  # a deployment's loop, in its actor
        from cluster.remote_runs import RemoteRunHandle

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


def start_here(workflow, cluster, strategy: str, chunk_tokens: int, call_timeout_s: float, transport: str | None,
               plan, lend_cores: bool, timeout_s: float | None, on_token=None, on_agent=None,
               keep_prefix_s: float | None = None) -> RunHandle:
    """`start` on a loop of this process: check and plan the run here, then hand it over."""
    called = time.perf_counter()
    workflow.validate(served_models=cluster.models)
    check_replicas(workflow, {r.name for r in cluster.replicas()})
    builders, eos, limits = prompt_builders({a.model for a in workflow.agents()})
    _check_sizes(workflow, builders, limits, cluster)
    events = []
    planning_s = 0.0
    if strategy == "auto" and plan is None:
        from aaflow.planning import plan_checked

        begun = time.perf_counter()
        try:
            plan = plan_checked(workflow, cluster, builders, chunk_tokens=chunk_tokens, transport=transport)
        except AAFlowError as exc:
            events.append(f"planner unavailable ({exc}); auto follows its documented rule")
        planning_s = time.perf_counter() - begun
    decisions = plan.decisions if strategy == "auto" and plan is not None else None
    if decisions:
        events.append(f"planner ({planning_s:.2f} s): " + ", ".join(f"{a}={s}" for a, s in decisions.items()))
    agents = workflow_agents(workflow, builders, strategy, decisions)
    service = service_for(cluster, chunk_tokens, call_timeout_s, transport, lend_cores)
    return service.submit(workflow, agents, builders, eos, strategy, events, on_token=on_token, on_agent=on_agent,
                          timeout_s=timeout_s, planning_s=planning_s, called=called, keep_prefix_s=keep_prefix_s)
