"""`aaflow bench transfer`: each KV transport's raw bandwidth and latency (`transport_rates`, skip
with `--skip-raw`), then SmolLM2 KV between two replicas in two processes, per transport.

For each context length: the downstream replica's TTFT when it receives the context's KV over a
transport (expose + fetch + import, then prefill the question) next to its TTFT when it
recomputes the context from text (the AAFLOW+ TTFT experiment, measured instead of modeled),
and the transport's bandwidth next to in-process memcpy bandwidth measured in the same run.
Prefix caching is off on both replicas so that nothing is served from cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from aaflow.benchmarks.common import add_dtype_argument, kv_bytes_per_token, log, machine_facts, write_json
from aaflow.benchmarks.transport_rates import measure_transports, print_table


def _context(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1000, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _transfer_once(ray, src, dst, ref_id: str, transport: str):
    """Expose on `src`, receive on `dst`; returns (record, stats, seconds until the KV is usable on
    `dst`, the source's pending release). The release frees only the source's staging buffer, so it
    runs off the critical path, as in the executor."""
    t0 = time.perf_counter()
    exposure = ray.get(src.expose.remote(ref_id, transport))
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    answer = ray.get(dst.receive.remote(handle, shape, record, transport))
    received, stats = answer.record, answer.stats
    wall = time.perf_counter() - t0
    return received, stats, wall, src.release.remote(handle, transport)


def run(args) -> dict:
    if getattr(args, "quick", False):
        args.lengths, args.repeats = [512, 4096], 2
    import ray

    from aaflow.models import resolve_model_path
    from aaflow.cluster.actors import replica_actor, start_ray
    from aaflow.cluster.transports import available_transports

    model = str(resolve_model_path(args.model))
    ready = [t for t, ok in available_transports().items() if ok is True and (not args.transports or t in args.transports)]
    transports = [t for t in ready if t != "local"]  # between two replica processes
    start_ray(num_cpus=2)
    raw = None
    if not args.skip_raw:  # the transports alone, before the replicas load (`local` as the in-process bound)
        raw = measure_transports(["local", *transports], args.size_mib, 4096, args.raw_repeats, 1)
        print_table(raw)
    pool = int(max(args.lengths) * 2.5) * kv_bytes_per_token(args.dtype)
    kw = dict(dtype=args.dtype, threads=args.threads, kv_cache_bytes=pool, prefix_caching=False)
    src, dst = replica_actor("bench-src", model, 0.5, **kw), replica_actor("bench-dst", model, 0.5, **kw)
    vocab = 49152
    question = _context(16, 999, vocab)
    rows = []
    try:
        ray.get([src.info.remote(), dst.info.remote()])
        bandwidth = ray.get(dst.memcpy_bandwidth.remote())  # where the fetches land, same run
        log(f"memcpy in the destination replica: {bandwidth / 1e9:.2f} GB/s")
        for n in args.lengths:
            ctx_seeds = iter(range(n * 100, n * 100 + 1000))
            recompute = [ray.get(dst.generate_text.remote(_context(n, next(ctx_seeds), vocab) + question, 1)).ttft_s
                         for _ in range(args.repeats)]
            row = {"tokens": n, "recompute_ttft_s": statistics.median(recompute), "transports": {}}
            for transport in transports:
                samples = []
                for _ in range(args.repeats + 1):  # first one warms registrations and pages
                    record = ray.get(src.materialize.remote(_context(n, next(ctx_seeds), vocab)))
                    received, stats, wall, release = _transfer_once(ray, src, dst, record.id, transport)
                    cont = ray.get(dst.generate.remote(received.id, question, 1))
                    ray.get(release)
                    samples.append({"fetch_s": stats.seconds, "transfer_wall_s": wall, "continue_ttft_s": cont.ttft_s,
                                    "nbytes": stats.nbytes})
                    ray.get([src.free.remote(record.id), dst.free.remote(received.id)])
                samples = samples[1:]
                med = {k: statistics.median(s[k] for s in samples) for k in samples[0] if k != "nbytes"}
                ttft = med["transfer_wall_s"] + med["continue_ttft_s"]
                row["transports"][transport] = {
                    **med, "nbytes": samples[0]["nbytes"], "ttft_s": ttft,
                    "fetch_bytes_per_s": samples[0]["nbytes"] / med["fetch_s"],
                    "fetch_fraction_of_memcpy": samples[0]["nbytes"] / med["fetch_s"] / bandwidth,
                    "ttft_reduction_x": row["recompute_ttft_s"] / ttft,
                    "context_ready_x": row["recompute_ttft_s"] / med["transfer_wall_s"],
                }
                t = row["transports"][transport]
                log(f"{n:>5} tokens, {transport:>5}: {t['nbytes'] / 2**20:6.1f} MiB fetched at "
                    f"{t['fetch_bytes_per_s'] / 1e9:5.2f} GB/s ({t['fetch_fraction_of_memcpy']:.0%} of memcpy); "
                    f"TTFT {ttft * 1e3:6.1f} ms vs recompute {row['recompute_ttft_s'] * 1e3:7.1f} ms "
                    f"= {t['ttft_reduction_x']:.1f}x (context ready {t['context_ready_x']:.0f}x sooner)")
            rows.append(row)
    finally:
        ray.get([src.close.remote(), dst.close.remote()])
        ray.shutdown()
    report = {"benchmark": "transfer", "machine": machine_facts(), "model": model,
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
              "memcpy_bytes_per_s": bandwidth, "rows": rows, "raw_transports": raw}
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    add_dtype_argument(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (two replicas share the cores)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8160],
                   help="context tokens (SmolLM2 has 8,192 positions; the question needs 16 of them)")
    p.add_argument("--transports", nargs="*", default=None, help="default: every available one")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/transfer.json")
    p.add_argument("--quick", action="store_true", help="two lengths, two repeats")
    p.add_argument("--skip-raw", action="store_true", help="skip the raw transports' bandwidth and latency")
    p.add_argument("--size-mib", type=int, default=64, help="the raw transports' large fetch")
    p.add_argument("--raw-repeats", type=int, default=5)


def _plot(out, report) -> None:
    from aaflow.benchmarks.plots import write_plot

    rows = report["rows"]
    names = sorted({t for r in rows for t in r["transports"]})
    ttft = {t: {r["tokens"]: r["transports"][t]["ttft_s"] * 1e3 for r in rows if t in r["transports"]}
            for t in names}
    ttft["recompute"] = {r["tokens"]: r["recompute_ttft_s"] * 1e3 for r in rows}
    fetch = {t: {r["tokens"]: r["transports"][t]["fetch_bytes_per_s"] / 1e9 for r in rows if t in r["transports"]}
             for t in names}
    write_plot(out, [
        {"title": "downstream TTFT", "xlabel": "context tokens", "ylabel": "ms", "logx": True, "logy": True,
         "series": ttft},
        {"title": "fetch bandwidth", "xlabel": "context tokens", "ylabel": "GB/s", "logx": True, "series": fetch,
         "hlines": {"memcpy (same run)": report["memcpy_bytes_per_s"] / 1e9}},
    ], suptitle="KV transfer between two replica processes (SmolLM2)")
