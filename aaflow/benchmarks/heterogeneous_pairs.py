"""`aaflow bench workflows --downstream-model M`: FlashAgents' stream-across-models case. A->B pairs
with A on SmolLM2 and B on model M, one replica each, so that only tokens cross the edge; B's response
latency (its first token - A's first token) and handoff gap (its first token - A's last), per
strategy, medians of repeats, strategies alternated inside each repeat, cold prefix caches."""

from __future__ import annotations

import statistics

from aaflow.benchmarks.common import kv_bytes_per_token, log
from aaflow.benchmarks.scaling_bench import cold_run, context_text
from aaflow.benchmarks.workflow_shapes import pair_workflow
from aaflow.cluster.cluster import init


def heterogeneous_pairs(args) -> dict:
    """Per pair count of `args.pairs`: each strategy's median response latency and handoff gap."""
    strategies = ["text"] + [s for s in dict.fromkeys([*args.strategies, "stream"]) if s not in ("text", "text-nocache")]
    # a replica holds every pair's B prompt at once (text passing computes each in full); sized in bf16
    kv_bytes = 256 * 2**20 * max(1, -(-max(args.pairs) // 8)) * kv_bytes_per_token(args.dtype) \
        // kv_bytes_per_token("bfloat16")
    cluster = init(replicas={"smollm2": 1, args.downstream_model: 1}, dtype=args.dtype, kv_cache_bytes=kv_bytes)
    out = {}
    try:
        for n in args.pairs:
            wf = pair_workflow(n, context_text(args.ablation_prefix_tokens, 113), args.a_tokens, args.downstream_model)
            for s in strategies:  # warm-up, not recorded
                cold_run(cluster, wf, s, args.chunk_tokens)
            samples = {s: [] for s in strategies}
            for _ in range(args.repeats):
                for s in strategies:
                    res = cold_run(cluster, wf, s, args.chunk_tokens)[0]
                    samples[s].append({
                        "response_latency_s": statistics.mean(res[f"B{i}"].first_token_s - res[f"A{i}"].first_token_s
                                                              for i in range(n)),
                        "handoff_gap_s": statistics.mean(res[f"B{i}"].handoff_gap_s for i in range(n)),
                        "wall_s": res.total_s})
            row = out[str(n)] = {s: {k: statistics.median(x[k] for x in v) for k in v[0]} for s, v in samples.items()}
            for s in strategies[1:]:
                row[s]["response_speedup_vs_text"] = row["text"]["response_latency_s"] / row[s]["response_latency_s"]
            log(f"A(smollm2)->B({args.downstream_model}) x{n}: "
                + ", ".join(f"{s} {row[s]['response_latency_s']:.2f} s" for s in strategies))
    finally:
        cluster.shutdown()
    return {"downstream_model": args.downstream_model, "pairs": out}
