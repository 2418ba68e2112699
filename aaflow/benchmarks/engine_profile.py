"""Where the built-in engine's time goes: torch.profiler over one prefill and one decode step.

    python -m aaflow.benchmarks.engine_profile [--dtype bfloat16]      (also part of `aaflow bench engine`)
    python -m aaflow.benchmarks.engine_profile --serving              (a serving burst's decode step)

Per phase: wall time, and the operators that take most of it (self CPU time summed over calls,
their share of the phase, calls), grouped as matmul / attention / KV write+read / other. The
compiled kernels (decode attention, fused elementwise) are not operators the profiler sees: their
time is the wall time the operators leave (`outside_operators_s`).

`--serving`: the decode step of a serving burst, 96 rows over 8 cached documents of 744 tokens (12
forks of each, 20 tokens of their own, rows interleaved as a batch holds them).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile as torch_profile

GROUPS = {"matmul": ("linear", "mkldnn", "addmm", "mm"), "attention": ("flash_attention", "scaled_dot_product"),
          "kv write/read": ("index_copy", "index_select", "index")}


def _group(op: str) -> str:
    return next((g for g, keys in GROUPS.items() if any(k in op for k in keys)), "other")


def _summary(prof, wall_s: float, top: int = 8) -> dict:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_us = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        groups[_group(e.key)] = groups.get(_group(e.key), 0.0) + e.self_cpu_time_total
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return {"wall_s": wall_s, "self_cpu_s": total_us / 1e6,
            "groups": {g: round(us / total_us, 3) for g, us in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"op": e.key, "share": round(e.self_cpu_time_total / total_us, 3), "calls": e.count}
                        for e in events[:top]]}


def profile(model: str, dtype: str, threads: int, prompt_len: int = 2048, decode_context: int = 1024,
            deterministic: bool = False) -> dict:
    from aaflow.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine.from_pretrained(model, dtype=dtype, prefix_caching=False, deterministic=deterministic)
    ids = torch.randint(1000, 40000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    seq = engine.new_sequence()
    engine.prefill(seq, ids[:64])  # warm-up
    engine.free(seq)
    seq = engine.new_sequence()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.prefill(seq, ids)
        wall = time.perf_counter() - t0
    out[f"prefill_{prompt_len}"] = _summary(prof, wall)
    engine.free(seq)
    seq = engine.new_sequence()
    engine.prefill(seq, ids[:decode_context])
    engine.decode([seq], [5])
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.decode([seq], [5])
        wall = time.perf_counter() - t0
    out[f"decode_step_b1_ctx{decode_context}"] = _summary(prof, wall)
    engine.free(seq)
    return out


def profile_serving_decode(model: str, dtype: str, threads: int, documents: int = 8, readers: int = 12,
                           doc_tokens: int = 744, own_tokens: int = 20, repeats: int = 5) -> dict:
    """The decode step of `documents` x `readers` forks of cached documents: median wall of
    `repeats`, then one step profiled."""
    import statistics

    from aaflow.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine.from_pretrained(model, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(documents):
        doc = engine.new_sequence()
        engine.prefill(doc, torch.randint(1000, 40000, (doc_tokens,), generator=gen).tolist())
        forks = [engine.fork(doc) for _ in range(readers)]
        engine.prefill_packed(forks, [torch.randint(1000, 40000, (own_tokens,), generator=gen).tolist()
                                      for _ in forks])
        rows += forks
    rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    tokens = [5] * len(rows)
    engine.decode(rows, tokens)  # warm-up
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.decode(rows, tokens)
        walls.append(time.perf_counter() - t0)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.decode(rows, tokens)
        wall = time.perf_counter() - t0
    out = _summary(prof, wall)
    out.update(rows=len(rows), median_step_s=statistics.median(walls), steps_s=walls,
               outside_operators_s=max(0.0, wall - out["self_cpu_s"]))  # the operators run on this thread
    return {f"decode_step_{len(rows)}_rows_over_{documents}_documents": out}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--serving", action="store_true", help="a serving burst's decode step instead")
    a = p.parse_args()
    if a.serving:
        print(json.dumps(profile_serving_decode(a.model, a.dtype, a.threads), indent=1))
    else:
        print(json.dumps(profile(a.model, a.dtype, a.threads, deterministic=a.deterministic), indent=1))
