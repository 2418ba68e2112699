"""Helpers every benchmark shares: medians of repeats, JSON output, machine facts."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from aaflow.engine.dtypes import DTYPES, native_bf16, resolve_dtype
from aaflow.common.machine import cpu_kind, cpu_model


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall seconds of `fn` over `repeats` runs after `warmup` untimed runs; also the samples."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def _busy_and_total() -> tuple[int, int]:
    """The machine's CPU ticks so far, busy and total (/proc/stat's first line; iowait counts idle)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return sum(ticks) - idle, sum(ticks)


def wait_until_quiet(busy_below: float = 0.1, window_s: float = 0.2, timeout_s: float = 10.0) -> float:
    """Wait until the cores are idle (busy under `busy_below` over a `window_s` window), at most
    `timeout_s`; returns the seconds waited. A side's timed run starts only once the other side's
    threads have stopped spinning (vLLM's keep the cores busy for a while after a batch returns)."""
    start = time.perf_counter()
    if not os.path.exists("/proc/stat"):
        return 0.0
    while time.perf_counter() - start < timeout_s:
        busy0, total0 = _busy_and_total()
        time.sleep(window_s)
        busy1, total1 = _busy_and_total()
        if total1 > total0 and (busy1 - busy0) / (total1 - total0) < busy_below:
            break
    return time.perf_counter() - start


def machine_facts() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),
        "native_bf16": native_bf16(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def kv_bytes_per_token(dtype: str, values_per_token: int = 11520) -> int:
    """KV bytes per token in `dtype` (default: SmolLM2-135M, 30 layers x K/V x 3 heads x 64)."""
    return values_per_token * DTYPES[dtype].itemsize


def add_dtype_argument(p) -> None:
    """`--dtype`, resolved when parsed: "auto" (default) is bfloat16 on CPUs with native bf16, else float32."""
    p.add_argument("--dtype", default="auto", type=resolve_dtype, metavar="{auto,bfloat16,float32}",
                   help="weights and KV (default auto: bfloat16 with native bf16, else float32)")


def write_json(path: str | os.PathLike, data: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    log(f"wrote {out}")
    return out


NO_LEND = "/no-lend"  # a strategy variant: the executor lends no idle cores (`af.run(lend_cores=False)`)


def run_options(strategy: str) -> dict:
    """`af.run` keyword arguments for a bench strategy name such as "auto" or "auto/no-lend"."""
    if strategy.endswith(NO_LEND):
        return {"strategy": strategy[: -len(NO_LEND)], "lend_cores": False}
    return {"strategy": strategy}


def engine_tokens_computed(cluster) -> int:
    """Tokens the replicas' engines ran through a forward pass so far (contexts included)."""
    import ray

    return sum(s["tokens_computed"] for s in ray.get([r.actor.stats.remote() for r in cluster.replicas()]))
