"""The `aaflow` command line: demo, chat, run, fetch-model, report, bench; plan, breakeven, calibrate
(`aaflow.cli_planning`); up, status, down, submit (`aaflow.cli_deploy`)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch

import aaflow as af
from aaflow.cli_deploy import add_deploy_commands
from aaflow.cli_options import DTYPE_ARG, DTYPE_HELP, parse_engines
from aaflow.cli_planning import add_planning_commands
from aaflow.demo import run_demo
from aaflow.engine import Engine
from aaflow.common.errors import AAFlowError
from aaflow.models import fetch_model
from aaflow.cluster.planning.split import calibrate_splits, choose_split
from aaflow.common.strategies import STRATEGIES
from aaflow.benchmarks import report as report_module

BENCHMARKS = {
    "engine": "aaflow.benchmarks.engine_bench",
    "memory": "aaflow.benchmarks.memory_bench",
    "fuzz": "aaflow.benchmarks.fuzz_bench",
    "soak": "aaflow.benchmarks.soak_bench",
    "transfer": "aaflow.benchmarks.transfer_bench",
    "compose": "aaflow.benchmarks.compose_bench",
    "crossover": "aaflow.benchmarks.crossover_bench",
    "netns-crossover": "aaflow.benchmarks.netns_crossover",
    "planner": "aaflow.benchmarks.planner_bench",
    "scaling": "aaflow.benchmarks.scaling_bench",
    "overhead": "aaflow.benchmarks.overhead_bench",
    "consistency": "aaflow.benchmarks.consistency_bench",
    "workflows": "aaflow.benchmarks.workflows_bench",
    "load": "aaflow.benchmarks.load_bench",
    "serve": "aaflow.benchmarks.serve_bench",
    "serve-trace": "aaflow.benchmarks.serve_trace",
    "loop-scale": "aaflow.benchmarks.loop_scale_bench",
    "endpoint": "aaflow.benchmarks.endpoint_bench",
    "chaos": "aaflow.benchmarks.chaos_bench",
    "overlap-bound": "aaflow.benchmarks.overlap_bound",
    "regression": "aaflow.benchmarks.regression_ab",
}
NOT_IN_ALL = {"regression"}  # compares two revisions of the code (needs --against), not the system


DEMO_QUESTION = "In two sentences, why do multi-agent LLM workflows waste compute re-reading shared context?"


def _demo(args) -> int:
    return run_demo(args.workflow, args.replicas, args.dtype, args.rounds, args.doc_tokens, args.deterministic,
                    args.kv_cache_bytes)


def _chat(args) -> int:
    torch.set_num_threads(args.threads)
    print(f"aaflow chat: loading {args.model} ({args.dtype}) with the built-in engine ...", flush=True)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, dtype=args.dtype)
    print(f"loaded in {time.perf_counter() - t0:.1f} s from {engine.model_path}")
    prompt = engine.chat_prompt(args.prompt)
    print(f"\nuser> {args.prompt}\n")
    out = engine.generate(prompt, max_new_tokens=args.max_tokens)
    print(f"assistant> {out.text.strip()}\n")
    print(f"prompt {len(out.prompt_token_ids)} tokens, generated {len(out.token_ids)} tokens "
          f"({out.finish_reason}); TTFT {out.ttft_s * 1e3:.0f} ms, "
          f"decode {out.decode_tokens_per_s:.1f} tokens/s, {args.threads} threads")
    return 0


def _run(args) -> int:
    wf = af.load_workflow(args.workflow)
    engine, engines = parse_engines(args.engine)
    options = {"deterministic": True} if args.deterministic else {}
    if args.kv_cache_bytes:
        options["kv_cache_bytes"] = args.kv_cache_bytes
    replicas = args.replicas
    if replicas == "auto":
        if engine != "builtin" or engines:
            raise SystemExit("aaflow run: --replicas auto splits the cores among built-in replicas; give vLLM a count")

        calibrate_splits(wf, args.dtype)
        choice = choose_split(wf, dtype=args.dtype)
        print(choice.explain())
        replicas = choice.replicas
    cluster = af.init(replicas={a.model: replicas for a in wf.agents()}, dtype=args.dtype,
                      engine=engine, engines=engines, **options)
    try:
        res = af.run(wf, cluster, strategy=args.strategy)
    finally:
        cluster.shutdown()
    for name, agent in res.agents.items():
        print(f"--- {name} ---\n{agent.text.strip()}\n")
    print(res.summary())
    return 0


def _replicas_arg(value: str) -> int | str:
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"replicas must be a count >= 1 or auto, got {value!r}")
    return int(value)


def _fetch_model(args) -> int:
    path = fetch_model(args.name, force=args.force)
    print(path)
    return 0


def _bench(args) -> int:
    if args.name == "all":
        for name, module_name in BENCHMARKS.items():
            if name in NOT_IN_ALL:
                continue
            module = importlib.import_module(module_name)
            sub = argparse.ArgumentParser()
            module.add_arguments(sub)
            quick = getattr(args, "quick", False) and any("--quick" in a.option_strings for a in sub._actions)
            print(f"aaflow bench all: {name}{' --quick' if quick else ''} ...", flush=True)
            module.run(sub.parse_args(["--quick"] if quick else []))
        return 0
    module = importlib.import_module(BENCHMARKS[args.name])
    module.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aaflow", description="aaflow: a distributed KV-state workflow runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a multi-agent review workflow on SmolLM2, text vs auto (and vLLM where set up)")
    demo.add_argument("--workflow", default=None, help="a workflow YAML (default: the shipped review)")
    demo.add_argument("--replicas", type=int, default=1,
                      help="SmolLM2 replicas sharing the cores (default 1: one replica on every core measured faster "
                           "on the workflows of docs/RESULTS.md)")
    demo.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    demo.add_argument("--rounds", type=int, default=2, help="runs of each strategy, alternating (median reported)")
    demo.add_argument("--doc-tokens", type=int, default=2000,
                      help="the shipped review's paper repeated to about this many tokens (0: once, ~560)")
    demo.add_argument("--deterministic", action="store_true",
                      help="batch- and chunk-invariant kernels: every strategy gives text's tokens in bf16 too "
                           "(built-in engine; decode up to 35%% slower)")
    demo.add_argument("--kv-cache-bytes", default=None, metavar="SIZE",
                      help="KV pool per replica, e.g. 2GiB (default: 10%% of memory shared by the replicas, "
                           "or $AAFLOW_KV_CACHE_BYTES)")
    demo.set_defaults(func=_demo)

    chat = sub.add_parser("chat", help="load a model with the built-in engine and answer one chat prompt")
    chat.add_argument("--model", default="smollm2")
    chat.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    chat.add_argument("--prompt", default=DEMO_QUESTION)
    chat.add_argument("--max-tokens", type=int, default=64)
    chat.add_argument("--threads", type=int, default=2)
    chat.set_defaults(func=_chat)

    run = sub.add_parser("run", help="run a workflow YAML on a local cluster and print a summary")
    run.add_argument("workflow")
    run.add_argument("--strategy", default="auto",
                     choices=STRATEGIES)
    run.add_argument("--replicas", type=_replicas_arg, default=1,
                     help="replicas per model (default 1: one replica on every core), or auto: the split of this "
                          "machine's cores the planner predicts fastest for this workflow (built-in engine)")
    run.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    run.add_argument("--engine", action="append", default=[], metavar="[MODEL=]ENGINE",
                     help="builtin (default) or vllm, for every model or one: --engine smollm2=vllm (repeatable; "
                          "vLLM needs `bash scripts/setup_vllm_env.sh`)")
    run.add_argument("--deterministic", action="store_true",
                      help="batch- and chunk-invariant kernels: every strategy gives text's tokens in bf16 too "
                           "(built-in engine; decode up to 35%% slower)")
    run.add_argument("--kv-cache-bytes", default=None, metavar="SIZE",
                      help="KV pool per replica, e.g. 2GiB (default: 10%% of memory shared by the replicas, "
                           "or $AAFLOW_KV_CACHE_BYTES)")
    run.set_defaults(func=_run)

    fetch = sub.add_parser("fetch-model", help="fetch a registered model (e.g. smollm2) into the cache")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true", help="download and convert again")
    fetch.set_defaults(func=_fetch_model)


    report = sub.add_parser("report", help="regenerate docs/RESULTS.md's summary table from docs/results/*.json")
    report_module.add_arguments(report)
    report.set_defaults(func=report_module.run)

    bench = sub.add_parser("bench", help="run a benchmark; writes JSON under results/")
    bench_sub = bench.add_subparsers(dest="name", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(func=_bench)
    bench_all = bench_sub.add_parser("all", help="every benchmark with its defaults")
    bench_all.add_argument("--quick", action="store_true", help="pass --quick to every benchmark that has it")
    bench_all.set_defaults(func=_bench)


    add_planning_commands(sub)
    add_deploy_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    try:
        return args.func(args)
    except AAFlowError as exc:
        print(f"aaflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
