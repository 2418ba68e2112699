"""`aaflow bench memory`: N agents sharing one long context, KV pool bytes with fork vs independent copies.

Both sides are measured from the pool's own block counts: `fork` materializes the shared
context once and extends N forks of it with each agent's private tokens; `copies` gives
each agent its own full copy of the same KV (imported from one export, byte-identical to N
prefills but without spending N prefills of time on it).
"""

from __future__ import annotations

import argparse
import time

import torch

from aaflow.benchmarks.common import add_dtype_argument, log, machine_facts, write_json


def run(args) -> dict:
    if getattr(args, "quick", False):
        args.context = min(args.context, 2048)
    import aaflow as af
    from aaflow.operators import KVHost, extend

    torch.set_num_threads(args.threads)
    need_tokens = args.agents * (args.context + args.private) + args.context
    engine = af.Engine.from_pretrained(args.model, dtype=args.dtype, prefix_caching=False,
                                       kv_cache_bytes=int(need_tokens * 1.1) * _bytes_per_token(args))
    host = KVHost(engine, name="bench")
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(1000, engine.config.vocab_size, (args.context,), generator=gen).tolist()
    privates = [torch.randint(1000, engine.config.vocab_size, (args.private,), generator=gen).tolist()
                for _ in range(args.agents)]
    t0 = time.perf_counter()
    shared = af.materialize(host, context)
    agents = [extend(shared, p) for p in privates]  # each forks the shared context, then adds its tail
    fork_s = time.perf_counter() - t0
    fork_bytes = host.used_bytes()
    log(f"fork: {args.agents} agents hold {fork_bytes / 2**20:.1f} MiB in {fork_s:.1f} s")
    export = engine.export_kv(host.sequence(shared))
    for ref in agents + [shared]:
        af.free(ref)
    assert engine.stats().used == 0, "every fork was freed"
    t0 = time.perf_counter()
    copies = []
    for p in privates:
        seq = engine.import_kv(export)
        engine.prefill(seq, p)
        copies.append(seq)
    copies_s = time.perf_counter() - t0
    copies_bytes = host.used_bytes()
    for seq in copies:
        engine.free(seq)
    log(f"copies: {args.agents} agents hold {copies_bytes / 2**20:.1f} MiB")
    report = {
        "benchmark": "memory", "machine": machine_facts(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
        "bytes_per_token": host.spec.bytes_per_token,
        "fork": {"pool_bytes": fork_bytes, "seconds": fork_s},
        "independent_copies": {"pool_bytes": copies_bytes, "seconds": copies_s},
        "memory_reduction_x": copies_bytes / fork_bytes,
        "ideal_reduction_x": args.agents * (args.context + args.private) / (args.context + args.agents * args.private),
    }
    log(f"memory reduction with fork: {report['memory_reduction_x']:.2f}x (AAFLOW+ reports 1.72-6.10x)")
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def _bytes_per_token(args) -> int:
    from aaflow.engine.config import ModelConfig
    from aaflow.models import resolve_model_path

    config = ModelConfig.from_folder(resolve_model_path(args.model))
    return config.kv_bytes_per_token(2 if args.dtype == "bfloat16" else 4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    add_dtype_argument(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--private", type=int, default=256)
    p.add_argument("--out", default="results/memory.json")
    p.add_argument("--quick", action="store_true", help="a 2,048-token context")


def _plot(out, report) -> None:
    from aaflow.benchmarks.plots import write_plot

    mib = {"fork": report["fork"]["pool_bytes"] / 2**20,
           "independent copies": report["independent_copies"]["pool_bytes"] / 2**20}
    write_plot(out, [{"title": f"KV pool bytes: {report['memory_reduction_x']:.2f}x smaller with fork",
                      "kind": "bar", "ylabel": "MiB", "series": {"pool": mib}}])
