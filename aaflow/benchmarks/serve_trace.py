"""`aaflow bench serve-trace`: where one burst's time goes, on aaflow's side and on vLLM's.

The load is `bench serve`'s burst (`--workflows` three-agent workflows over `--documents`
documents, from one client thread each), run once per side after a warm-up, caches cold.

aaflow: the cluster's scheduling loop is watched at its backend (each call: replica, kind, decode
rows, prompt tokens, when the loop submitted it and when the loop saw it end) and each replica
answers its own call log (`call_log`: when each call started there and how long it ran). Matched
call by call (a replica runs its calls in the order they were sent), they give:
* replica busy seconds per call kind (calls, seconds, decode rows, prompt tokens);
* the replica's idle time inside the load, split into the gaps where the loop had not yet sent the
  next call (the loop's own work: seeing an end, deciding, launching) and those where the call was
  on its way (Ray's dispatch), and the time before the first call (tokenizing, planning, admission);
* decode steps: batch sizes and milliseconds per step by batch size; prefill passes: prompt tokens
  per pass and milliseconds per thousand tokens; decode rows over time (1 s bins).
vLLM: the same load on `AsyncLLM` in one configuration (`--vllm-mode`, `--vllm-block-size`) with
its per-step stats (requests running, tokens generated per step, prompt tokens computed).
"""

from __future__ import annotations

import argparse
import statistics
import time

from aaflow.benchmarks.common import add_dtype_argument, log, machine_facts, wait_until_quiet, write_json
from aaflow.benchmarks.serve_shapes import documents, percentile, serve_workflows, warm_up_load
from aaflow.benchmarks.vllm_config import MODES, VllmConfig, code_commit


class LoopRecorder:
    """Records every call a scheduler's backend submits and when the loop sees it end."""

    def __init__(self, backend) -> None:
        self.backend, self.calls = backend, {}
        self._submit, self._wait = backend.submit, backend.wait
        backend.submit, backend.wait = self.submit, self.wait

    def submit(self, replica: str, call):
        ticket = self._submit(replica, call)
        decode = len(call.sids) if hasattr(call, "sids") else 0
        self.calls[ticket] = {"replica": replica, "kind": call.kind.name, "rows": decode,
                              "tokens": call.tokens,
                              "steps": getattr(call, "steps", 1 if decode else 0), "submit": time.time()}
        return ticket

    def wait(self, tickets, num_returns: int, timeout_s: float):
        ready = self._wait(tickets, num_returns, timeout_s)
        now = time.time()
        for ticket in ready:
            self.calls[ticket].setdefault("seen", now)
        return ready

    def close(self) -> list[dict]:
        """Stop recording; the calls in submission order."""
        self.backend.submit, self.backend.wait = self._submit, self._wait
        return [self.calls[t] for t in sorted(self.calls, key=lambda t: t.seq)]


def matched(calls: list[dict], logs: dict[str, list]) -> list[dict]:
    """The loop's calls with each replica's own start and seconds (the n-th call sent to a replica
    is the n-th it ran); calls of a replica whose log does not line up are left unmatched."""
    out = []
    for replica, log_entries in logs.items():
        mine = [c for c in calls if c["replica"] == replica]
        if len(mine) != len(log_entries):
            log(f"trace: {replica} ran {len(log_entries)} calls, the loop sent {len(mine)}: not matched")
            continue
        for call, (_method, start, seconds, computed) in zip(mine, log_entries):
            out.append({**call, "start": start, "seconds": seconds, "computed": computed})
    return out


def breakdown(calls: list[dict], begin: float, wall_s: float) -> dict:
    """The figures of the module docstring, from matched calls (times in `time.time()`)."""
    calls = sorted(calls, key=lambda c: c["start"])
    busy = sum(c["seconds"] for c in calls)
    kinds: dict[str, dict] = {}
    for c in calls:
        k = kinds.setdefault(c["kind"], {"calls": 0, "seconds": 0.0, "rows": 0, "tokens": 0, "computed": 0})
        for key in ("seconds", "rows", "tokens", "computed"):
            k[key] += c[key]
        k["calls"] += 1
    loop_gap = dispatch_gap = 0.0
    for prev, nxt in zip(calls, calls[1:]):
        ended = prev["start"] + prev["seconds"]
        gap = max(0.0, nxt["start"] - ended)
        late = max(0.0, min(gap, nxt["submit"] - ended))  # the loop had not sent it yet
        loop_gap += late
        dispatch_gap += gap - late
    steps = [c for c in calls if c["rows"] and not c["tokens"]]
    per_step = {}
    for lo, hi in ((1, 8), (8, 32), (32, 96), (96, 100_000)):
        ms = [1e3 * c["seconds"] / c["steps"] for c in steps if lo <= c["rows"] < hi]
        if ms:
            per_step[f"{lo}-{hi - 1 if hi < 100_000 else ''}"] = {"steps": len(ms), "ms_median": statistics.median(ms)}
    prefills = [c for c in calls if c["tokens"]]
    bins: dict[int, int] = {}
    for c in steps:
        bins[int(c["start"] - begin)] = max(bins.get(int(c["start"] - begin), 0), c["rows"])
    return {
        "wall_s": wall_s, "replica_busy_s": busy, "replica_idle_s": wall_s - busy,
        "before_first_call_s": calls[0]["start"] - begin if calls else None,
        "gaps_loop_not_sent_s": loop_gap, "gaps_in_dispatch_s": dispatch_gap,
        "after_last_call_s": begin + wall_s - (calls[-1]["start"] + calls[-1]["seconds"]) if calls else None,
        "round_trip_ms_median": statistics.median(1e3 * (c["seen"] - c["submit"] - c["seconds"])
                                                  for c in calls if "seen" in c) if calls else None,
        "by_kind": kinds,
        "decode": {"calls": len(steps), "steps": sum(c["steps"] for c in steps),
                   "batch_median": statistics.median(c["rows"] for c in steps) if steps else 0,
                   "batch_p90": percentile([c["rows"] for c in steps], 0.9) if steps else 0,
                   "batch_max": max((c["rows"] for c in steps), default=0), "ms_per_step_by_batch": per_step},
        "prefill": {"passes": len(prefills), "tokens": sum(c["tokens"] for c in prefills),
                    "computed": sum(_prompt_computed(c) for c in prefills),
                    "computed_median": statistics.median(_prompt_computed(c) for c in prefills) if prefills else 0,
                    "computed_max": max((_prompt_computed(c) for c in prefills), default=0),
                    "with_decode_rows": sum(1 for c in prefills if c["rows"])},
        "decode_rows_by_second": [bins.get(s, 0) for s in range(int(wall_s) + 1)],
        "calls": [{"at_s": round(c["start"] - begin, 4), "kind": c["kind"], "rows": c["rows"], "tokens": c["tokens"],
                   "computed": c["computed"], "steps": c["steps"], "seconds": round(c["seconds"], 4)}
                  for c in calls if c["rows"] or c["tokens"]],
    }


def _prompt_computed(call: dict) -> int:
    """Prompt tokens a call computed: the engine's count less its decode rows."""
    return call["computed"] - call["rows"] * call["steps"]


def vllm_breakdown(iterations: list, wall_s: float) -> dict:
    """vLLM's engine steps: how many, requests running, tokens generated per step over time."""
    gen = [it[3] for it in iterations]
    running = [it[1] for it in iterations if it[1] is not None]
    bins: dict[int, int] = {}
    for it in iterations:
        bins[int(it[0])] = max(bins.get(int(it[0]), 0), it[3])
    return {"wall_s": wall_s, "steps": len(iterations), "ms_per_step_mean": 1e3 * wall_s / max(1, len(iterations)),
            "generated_per_step_median": statistics.median(gen) if gen else 0,
            "generated_per_step_p90": percentile(gen, 0.9) if gen else 0,
            "running_median": statistics.median(running) if running else 0,
            "prompt_tokens_computed": sum(it[4] for it in iterations),
            "generated_by_second": [bins.get(s, 0) for s in range(int(wall_s) + 1)]}


def run(args) -> dict:
    import ray

    import aaflow as af
    from aaflow.benchmarks.serve_load import run_threads
    from aaflow.cluster.ray_backend import service_for

    docs = documents(args.documents, args.doc_tokens)
    workflows = serve_workflows(args.workflows, docs, args.max_tokens, hot=args.hot_documents)
    report = {"benchmark": "serve-trace", "machine": machine_facts(), "code_commit": code_commit(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")}}
    cluster = af.init(replicas={"smollm2": args.replicas}, dtype=args.dtype)
    try:
        af.run(warm_up_load()[0], cluster, strategy=args.strategy)  # kernels
        for wf in workflows[:len(docs)]:
            af.plan(wf, cluster, progress=None)
        replicas = cluster.replicas()
        ray.get([r.actor.clear_prefix_cache.remote() for r in replicas])
        wait_until_quiet()
        loop = service_for(cluster)
        recorder, cpu0, begin = LoopRecorder(loop.scheduler.backend), loop.cpu_s, time.time()
        out = run_threads(cluster, workflows, [0.0] * len(workflows), args.strategy)
        calls = recorder.close()
        logs = {r.name: [e for e in ray.get(r.actor.call_log.remote(begin)) if e[0] != "clear_prefix_cache"]
                for r in replicas}
        both = matched(calls, logs)
        report["aaflow"] = breakdown(both, begin, out["wall_s"])  # with several replicas: their gaps interleave
        report["aaflow"]["loop_cpu_s"] = loop.cpu_s - cpu0
        if len(replicas) > 1:
            report["aaflow"]["per_replica"] = {r.name: breakdown([c for c in both if c["replica"] == r.name], begin,
                                                                 out["wall_s"]) for r in replicas}
    finally:
        cluster.shutdown()
    if args.vllm:
        report["vllm"] = _vllm_side(args, workflows)
    write_json(args.out, report)
    _print(report)
    return report


def _vllm_side(args, workflows) -> dict:
    from aaflow.engine.kv_budget import default_kv_cache_bytes
    from aaflow.benchmarks.baseline_engines import load_specs
    from aaflow.benchmarks.vllm_tuning import start_runner

    config = VllmConfig(args.vllm_mode, args.vllm_block_size)
    with start_runner(config, default_kv_cache_bytes(1)) as runner:
        wait_until_quiet()
        load = runner.run_load(load_specs(workflows), trace=True)
    return {"config": config.label, "engine": load["engine"], "counters": load["vllm_counters"],
            **vllm_breakdown(load["iterations"], load["wall_s"])}


def _print(report: dict) -> None:
    a = report["aaflow"]
    log(f"aaflow: wall {a['wall_s']:.2f} s, replica busy {a['replica_busy_s']:.2f} s, before the first call "
        f"{a['before_first_call_s']:.2f} s, loop-not-sent gaps {a['gaps_loop_not_sent_s']:.2f} s, dispatch gaps "
        f"{a['gaps_in_dispatch_s']:.2f} s, loop CPU {a['loop_cpu_s']:.2f} s")
    for name, r in a.get("per_replica", {}).items():
        log(f"  {name}: busy {r['replica_busy_s']:.2f} s, loop-not-sent gaps {r['gaps_loop_not_sent_s']:.2f} s, "
            f"dispatch gaps {r['gaps_in_dispatch_s']:.2f} s, after its last call {r['after_last_call_s']:.2f} s")
    for kind, k in sorted(a["by_kind"].items(), key=lambda kv: -kv[1]["seconds"]):
        log(f"  {kind:12s} {k['calls']:5d} calls {k['seconds']:7.2f} s  rows {k['rows']:6d}  prompt tokens "
            f"{k['tokens']:6d} (computed {k['computed']})")
    log(f"  decode: {a['decode']}")
    log(f"  prefill: {a['prefill']}")
    if "vllm" in report:
        v = report["vllm"]
        log(f"vLLM {v['config']}: wall {v['wall_s']:.2f} s, {v['steps']} steps ({v['ms_per_step_mean']:.1f} ms each), "
            f"generated per step median {v['generated_per_step_median']}, running median {v['running_median']}, "
            f"prompt tokens computed {v['prompt_tokens_computed']}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workflows", type=int, default=64)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=700)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--hot-documents", type=int, default=0, metavar="H", help="the skewed shape (see bench serve)")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--replicas", type=int, default=1, help="aaflow replicas (the machine's cores split among them)")
    p.add_argument("--no-vllm", dest="vllm", action="store_false")
    p.add_argument("--vllm-mode", default="graph", choices=list(MODES))
    p.add_argument("--vllm-block-size", type=int, default=32)
    add_dtype_argument(p)
    p.add_argument("--out", default="results/trace_serve.json")  # not serve*.json: the serving table reads those
