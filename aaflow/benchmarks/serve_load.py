"""aaflow's side of `aaflow bench serve`: a load of workflows from client threads or processes, and
the prompt tokens the replicas computed for it (their engines' counters).

Each workflow is run by its own client (a thread calling `af.run`, or `af.submit` from one of
several processes on a deployment), started at its arrival offset. Its latency runs from its
arrival to its `RunResult`, as the client waits (prompts tokenized, planning, the run); an agent's
time to first token from when it could start (the run's arrival, or its last input's last token).
"""

from __future__ import annotations

import threading
import time


def agent_ttfts(result) -> list[float]:
    """Per agent: first token minus when it could start (seconds)."""
    out = []
    for agent in result.agents.values():
        if agent.first_token_s is None:
            continue
        out.append(agent.handoff_gap_s if agent.handoff_gap_s is not None else agent.first_token_s)
    return out


def run_threads(cluster, workflows: list, offsets: list[float], strategy: str = "auto", sample=None,
                begin: float | None = None) -> dict:
    """Each workflow from its own thread at its offset; answers per workflow its latency, tokens,
    time-to-first-token per agent, prompt tokens computed / reused and agent restarts (preemptions, replica deaths) (or its error).
    `sample()` is called every 0.2 s while the load runs (a KV monitor). Offsets count from `begin`
    (a `time.perf_counter()` instant; now by default)."""
    import aaflow as af

    rows: list[dict | None] = [None] * len(workflows)
    begin = time.perf_counter() if begin is None else begin

    def client(i: int) -> None:
        time.sleep(max(0.0, begin + offsets[i] - time.perf_counter()))
        arrived = time.perf_counter()
        try:
            res = af.run(workflows[i], cluster, strategy=strategy)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            rows[i] = {"error": f"{type(exc).__name__}: {exc}", "latency_s": time.perf_counter() - arrived}
            return
        rows[i] = row_of(res, arrived, time.perf_counter())

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(workflows))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if sample is not None:
            sample()
        time.sleep(0.2)
    ends = [r["end_s"] for r in rows if "end_s" in r]  # the last completion, not the last 0.2 s tick
    return {"rows": rows, "wall_s": (max(ends) if ends else time.perf_counter()) - begin, "begin": begin}


def row_of(res, arrived: float, ended: float) -> dict:
    """One workflow's figures from its RunResult."""
    m = res.metrics
    return {"latency_s": ended - arrived, "end_s": ended, "ttft_s": agent_ttfts(res),
            "tokens": {n: a.token_ids for n, a in res.agents.items()},
            "generated": sum(a.decoded for a in res.agents.values()),
            "prompt_computed": m["prefill_computed"], "prompt_reused": m["prefill_reused"],
            "restarts": sum(a.restarts for a in res.agents.values())}


def replicas_computed(cluster) -> int | None:
    """Tokens the cluster's built-in replicas have computed (prompt tokens and decode rows), by their
    engines' counters; None with vLLM replicas (their counter holds prompt tokens only)."""
    from aaflow.benchmarks.common import engine_tokens_computed

    if any(r.engine != "builtin" for r in cluster.replicas()):
        return None
    return engine_tokens_computed(cluster)


def prompt_computed_by_replicas(summary: dict, computed: int | None, workflows: list) -> None:
    """`summary["prompt_computed"]` as the replicas computed it: every token their engines computed
    less the decode rows (each agent's tokens but the first, which its prefill gives). A request's
    usage counts a shared prefix that a separate call materialized as reused, so the clients' sum
    (kept as `prompt_computed_by_requests`) leaves those tokens out; vLLM's side counts from its
    engines' prefix-cache counters, as this does."""
    if computed is None or summary["completed"] != len(workflows) or summary.get("restarts"):
        return  # decode rows of failed or restarted agents are unknown: keep the clients' figure
    decode_rows = summary["generated_tokens"] - sum(len(wf.agents()) for wf in workflows)
    summary["prompt_computed_by_requests"] = summary["prompt_computed"]
    summary["prompt_computed"] = computed - decode_rows
