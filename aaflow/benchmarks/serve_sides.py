"""Both sides of one `aaflow bench serve` load, summarized alike: aaflow's (threads, processes or
HTTP clients on a cluster) and vLLM's (a runner's load), their medians over repeats, and aaflow's
ratios against the vLLM configuration the tuning kept."""

from __future__ import annotations

import statistics

from aaflow.benchmarks.serve_load import prompt_computed_by_replicas, replicas_computed, run_threads
from aaflow.benchmarks.serve_shapes import percentile


def summarize(rows: list[dict], wall_s: float) -> dict:
    """Throughput and latency figures of one load's per-workflow rows (each workflow's latency kept)."""
    done = [r for r in rows if r and "error" not in r]
    lat = [r["latency_s"] for r in done]
    ttft = [t for r in done for t in r.get("ttft_s", [])]
    out = {"completed": len(done), "failed": [r["error"] for r in rows if r and "error" in r], "wall_s": wall_s,
           "latencies_s": [r.get("latency_s") if r else None for r in rows],  # in workflow order: find the tail
           "workflows_per_min": 60 * len(done) / wall_s if wall_s else 0.0,
           "generated_tokens": sum(r.get("generated", 0) for r in done),
           "prompt_computed": sum(r.get("prompt_computed", 0) for r in done),
           "prompt_reused": sum(r.get("prompt_reused", 0) for r in done),
           "restarts": sum(r.get("restarts", 0) for r in done)}
    out["tokens_per_s"] = out["generated_tokens"] / wall_s if wall_s else 0.0
    if lat:
        out.update(latency_p50_s=statistics.median(lat), latency_p99_s=percentile(lat, 0.99))
    if ttft:
        out.update(ttft_p50_s=statistics.median(ttft), ttft_p99_s=percentile(ttft, 0.99))
    return out


def aaflow_load(cluster, workflows: list, offsets: list[float], strategy: str, alone: dict | None,
                clients=run_threads) -> dict:
    """One load on aaflow, from `clients` (`run_threads` on `cluster`, or a function of the same
    arguments running them from processes); with `alone` ({workflow name: tokens}), which
    workflows' tokens differ."""
    import ray

    from aaflow.cluster.ray_backend import service_for

    peak: dict[str, int] = {}

    def sample() -> None:
        for r in cluster.replicas():
            peak[r.name] = max(peak.get(r.name, 0), ray.get(r.actor.stats.remote())["used_blocks"])

    ray.get([r.actor.clear_prefix_cache.remote() for r in cluster.replicas()])  # cold, as vLLM's side is
    local = clients is run_threads and getattr(cluster, "scheduler", None) is None  # a deployment's loop: its actor
    loop = service_for(cluster) if local else None
    cpu_before, computed_before = loop.cpu_s if loop else 0.0, replicas_computed(cluster)
    out = clients(cluster, workflows, offsets, strategy, sample)
    summary = summarize(out["rows"], out["wall_s"])
    computed_after = replicas_computed(cluster)
    prompt_computed_by_replicas(summary, None if computed_after is None else computed_after - computed_before,
                                 workflows)
    summary["kv_peak_blocks"] = peak
    if loop is not None:  # the share of one core the scheduling loop used: how many replicas one loop drives
        summary["loop_cpu_s"] = loop.cpu_s - cpu_before
        summary["loop_cpu_share"] = summary["loop_cpu_s"] / out["wall_s"]
    if alone is not None:
        summary["differ_from_alone"] = [wf.name for wf, r in zip(workflows, out["rows"])
                                        if r and "tokens" in r and r["tokens"] != alone[wf.name]]
    return summary


def vllm_load(runner, specs: list, offsets: list[float], ignore_eos: bool, client: str = "plain") -> dict:
    out = runner.run_load(specs, offsets, ignore_eos=ignore_eos, client=client)
    rows = [{"latency_s": w["latency_s"], "ttft_s": [a["ttft_s"] for a in w["agents"]],
             "generated": sum(a["tokens"] for a in w["agents"])} for w in out["workflows"]]
    summary = summarize(rows, out["wall_s"])
    summary.update(prompt_tokens=out["prompt_tokens"], cached_prompt_tokens=out["cached_prompt_tokens"],
                   prompt_computed=out["prompt_tokens"] - out["cached_prompt_tokens"],
                   prompt_reused=out["cached_prompt_tokens"], **out["vllm_counters"])
    return summary


def medians(samples: list[dict]) -> dict:
    keys = [k for k, v in samples[0].items() if isinstance(v, (int, float))]
    out = {k: statistics.median(s[k] for s in samples if k in s) for k in keys}
    out["samples"] = samples
    return out


def compare(sides: dict, tuning: dict | None = None) -> dict:
    """Both sides' medians, the vLLM configuration the tuning pass kept (`tuning`: its wall per
    configuration), and aaflow's ratios against it."""
    vllm = {k: v for k, v in sides.items() if k.startswith("vllm") and "+" not in k}
    graph_aware = {k: v for k, v in sides.items() if k.startswith("vllm") and "+" in k}
    out = {"aaflow": sides["aaflow"]}
    if "aaflow-http" in sides:  # the endpoint against af.submit on the same deployment
        http = out["http"] = sides["aaflow-http"]
        out["http_throughput_ratio"] = http["workflows_per_min"] / sides["aaflow"]["workflows_per_min"]
    if vllm:
        (label, best), = vllm.items()
        out.update(vllm=best, vllm_mode=label, vllm_tuning_wall_s=tuning or {})
        a = sides["aaflow"]
        out["throughput_ratio"] = a["workflows_per_min"] / best["workflows_per_min"] if best["workflows_per_min"] else None
        for q in ("latency_p50_s", "latency_p99_s"):
            if q in a and q in best:
                out[f"{q}_ratio"] = a[q] / best[q]
    if graph_aware:  # vLLM clients that know the graph: the target is against the fastest of them
        out["vllm_graph_aware"] = graph_aware
        fastest = max(graph_aware, key=lambda k: graph_aware[k]["workflows_per_min"])
        out["graph_aware_best"] = fastest
        out["graph_aware_throughput_ratio"] = (sides["aaflow"]["workflows_per_min"]
                                               / graph_aware[fastest]["workflows_per_min"])
        for q in ("latency_p50_s", "latency_p99_s"):
            if q in sides["aaflow"] and q in graph_aware[fastest]:
                out[f"graph_aware_{q}_ratio"] = sides["aaflow"][q] / graph_aware[fastest][q]
    return out
