"""`aaflow bench overhead`: operator overheads on a cluster and incremental-prefill overhead (exp5).

1. Operators through the public API on a 2-replica SmolLM2 cluster with a tiny context
   (`--op-tokens`, so per-call latency dominates, not compute): median seconds of
   `af.materialize(cluster, "smollm2", text)`, `af.fork(kv, 2)`, `af.compose(a, b, mode="rerotate")`
   (two contexts materialized separately on one replica), `af.transfer(kv, other_replica)` (setup +
   bytes of a tiny KV: expose, receive, release), `af.evict(kv)` and `af.free(kv)`, next to an empty
   actor round trip (`stats()`), the floor of any remote call. Each iteration uses a fresh text so
   no prefix cache serves it.
2. Incremental prefill in process (`af.Engine.from_pretrained("smollm2")`, bf16, no prefix cache): a
   `--prompt-tokens` prompt prefilled in one pass vs in chunks of 16..512 tokens on one sequence
   (`engine.prefill(seq, ids, chunk_size=c)`, one forward pass per chunk; results equal one pass).
   Ratio chunked / one-pass per chunk size (medians; one-pass and chunked alternate in each repeat),
   next to FlashAgents' GPU figures (about 3x at 128-token chunks, 1.2x at 512).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from aaflow.benchmarks.common import add_dtype_argument, log, machine_facts, write_json

FLASHAGENTS_GPU = {"128": 3.0, "512": 1.2}


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def operator_overheads(args) -> dict:
    import ray

    import aaflow as af

    cluster = af.init(replicas={"smollm2": 2}, dtype=args.dtype)
    r0, r1 = cluster.replicas("smollm2")
    base = " ".join(["The agents share this context."] * max(1, args.op_tokens // 6))
    samples: dict[str, list[float]] = {k: [] for k in
                                       ("actor_roundtrip", "materialize", "fork", "compose_rerotate", "transfer",
                                        "evict", "free")}
    try:
        for i in range(args.op_repeats + 1):  # the first iteration warms up and is dropped
            s = {}
            _, s["actor_roundtrip"] = _timed(lambda: ray.get(r0.actor.stats.remote()))
            kv, s["materialize"] = _timed(lambda: af.materialize(cluster, "smollm2", f"Note {i}. {base}", replica=r0))
            other = af.materialize(cluster, "smollm2", f"Appendix {i}. {base}", replica=r0)
            (a, b), s["fork"] = _timed(lambda: af.fork(kv, 2))
            c, s["compose_rerotate"] = _timed(lambda: af.compose(a, other, mode="rerotate"))
            moved, s["transfer"] = _timed(lambda: af.transfer(kv, r1))
            for ref in (c, a, b, other):
                af.free(ref)
            _, s["free"] = _timed(lambda: af.free(moved))
            _, s["evict"] = _timed(lambda: af.evict(kv))
            try:
                af.free(kv)
            except Exception:  # noqa: BLE001 - an evicted ref may already be gone
                pass
            if i:
                for k, v in s.items():
                    samples[k].append(v)
        tokens = len(af.materialize(cluster, "smollm2", f"Count. {base}", replica=r0))
    finally:
        cluster.shutdown()
    ops = {k: {"median_s": statistics.median(v), "samples_s": v} for k, v in samples.items()}
    for k, v in ops.items():
        log(f"{k:>17}: {v['median_s'] * 1e3:7.2f} ms")
    return {"context_tokens": tokens, "operators": ops}


def chunked_prefill(args) -> dict:
    import aaflow as af

    torch.set_num_threads(args.threads)
    engine = af.Engine.from_pretrained("smollm2", dtype=args.dtype, prefix_caching=False,
                                       kv_cache_bytes=(args.prompt_tokens + 64) * 23040 * 4)
    ids = torch.randint(1000, engine.config.vocab_size, (args.prompt_tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()

    def prefill(chunk):
        seq = engine.new_sequence()
        t0 = time.perf_counter()
        engine.prefill(seq, ids, chunk_size=chunk)
        dt = time.perf_counter() - t0
        engine.free(seq)
        return dt

    prefill(None)  # warm-up
    one_pass, chunked = [], {c: [] for c in args.chunks}
    for _ in range(args.prefill_repeats):
        one_pass.append(prefill(None))
        for c in args.chunks:
            chunked[c].append(prefill(c))
    base = statistics.median(one_pass)
    rows = {}
    for c, v in chunked.items():
        med = statistics.median(v)
        rows[str(c)] = {"median_s": med, "ratio_vs_one_pass": med / base, "passes": -(-args.prompt_tokens // c),
                        "flashagents_gpu_ratio": FLASHAGENTS_GPU.get(str(c))}
        log(f"chunk {c:>4}: {med:.3f} s vs one pass {base:.3f} s = {med / base:.2f}x"
            + (f" (FlashAgents GPU ~{FLASHAGENTS_GPU[str(c)]}x)" if str(c) in FLASHAGENTS_GPU else ""))
    return {"prompt_tokens": args.prompt_tokens, "one_pass_s": base, "one_pass_samples_s": one_pass, "chunks": rows}


def run(args) -> dict:
    if args.quick:
        args.prompt_tokens = args.prompt_tokens or 1024
        args.op_repeats = args.op_repeats or 5
        args.prefill_repeats = args.prefill_repeats or 1
    args.prompt_tokens = args.prompt_tokens or 2048
    args.op_repeats = args.op_repeats or 20
    args.prefill_repeats = args.prefill_repeats or 3
    report = {"benchmark": "overhead", "machine": machine_facts(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
              "flashagents_gpu": FLASHAGENTS_GPU}
    if not args.skip_operators:
        report["operators"] = operator_overheads(args)
    report["chunked_prefill"] = chunked_prefill(args)
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def _plot(out, report) -> None:
    from aaflow.benchmarks.plots import write_plot

    cp = report["chunked_prefill"]["chunks"]
    panels = []
    if "operators" in report:
        panels.append({"title": f"operator latency ({report['operators']['context_tokens']}-token KV)", "kind": "bar",
                       "ylabel": "ms", "series": {"median": {k: v["median_s"] * 1e3 for k, v in
                                                             report["operators"]["operators"].items()}}})
    panels.append({"title": f"chunked / one-pass prefill ({report['chunked_prefill']['prompt_tokens']} tokens)",
                   "xlabel": "chunk tokens", "ylabel": "x", "logx": True,
                   "series": {"measured (CPU)": {int(c): r["ratio_vs_one_pass"] for c, r in cp.items()},
                              "FlashAgents (GPU)": {int(c): v for c, v in FLASHAGENTS_GPU.items()}},
                   "hlines": {"one pass": 1.0}})
    write_plot(out, panels)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="1,024-token prompt, 5 operator repeats, 1 prefill repeat")
    add_dtype_argument(p)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-process engine")
    p.add_argument("--op-tokens", type=int, default=32, help="about this many tokens of context for the operators")
    p.add_argument("--op-repeats", type=int, default=None, help="default 20 (quick: 5)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 2048 (quick: 1024)")
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--prefill-repeats", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--skip-operators", action="store_true", help="only the in-process chunked-prefill part")
    p.add_argument("--out", default="results/overhead.json")
