"""Where the built-in engine's time goes: torch.profiler over one prefill and one decode step.

    python -m aaflow.benchmarks.engine_profile [--dtype bfloat16]      (also part of `aaflow bench engine`)

Per phase: wall time, and the operators that take most of it (self CPU time summed over calls,
their share of the phase, calls), grouped as matmul / attention / KV write+read / other.
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--deterministic", action="store_true")
    a = p.parse_args()
    print(json.dumps(profile(a.model, a.dtype, a.threads, deterministic=a.deterministic), indent=1))
