"""The `aaflow` command line: demo, chat, run, plan, calibrate, fetch-model, bench; up, status, down, submit
(`aaflow.cli_deploy`)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from aaflow.strategies import STRATEGIES

BENCHMARKS = {
    "engine": "benchmarks.engine_bench",
    "memory": "benchmarks.memory_bench",
    "fuzz": "benchmarks.fuzz_bench",
    "soak": "benchmarks.soak_bench",
    "transfer": "benchmarks.kv_transfer_bench",
    "workflow": "benchmarks.workflow_bench",
    "compose": "benchmarks.compose_bench",
    "crossover": "benchmarks.crossover_bench",
    "netns-crossover": "benchmarks.netns_crossover",
    "planner": "benchmarks.planner_bench",
    "scaling": "benchmarks.scaling_bench",
    "overhead": "benchmarks.overhead_bench",
    "consistency": "benchmarks.consistency_bench",
    "workflows": "benchmarks.workflows_bench",
    "load": "benchmarks.load_bench",
    "chaos": "benchmarks.chaos_bench",
}

DTYPE_ARG = ["auto", "bfloat16", "float32"]
DTYPE_HELP = "weights and KV (default auto: bfloat16 on CPUs with native bf16, else float32)"

DEMO_QUESTION = "In two sentences, why do multi-agent LLM workflows waste compute re-reading shared context?"


def _demo(args) -> int:
    from aaflow.demo import run_demo

    return run_demo(args.workflow, args.replicas, args.dtype, args.rounds, args.doc_tokens, args.deterministic,
                    args.kv_cache_bytes)


def _chat(args) -> int:
    import torch

    from aaflow.engine import Engine

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
    import aaflow as af

    wf = af.load_workflow(args.workflow)
    engine, engines = parse_engines(args.engine)
    options = {"deterministic": True} if args.deterministic else {}
    if args.kv_cache_bytes:
        options["kv_cache_bytes"] = args.kv_cache_bytes
    replicas = args.replicas
    if replicas == "auto":
        if engine != "builtin" or engines:
            raise SystemExit("aaflow run: --replicas auto splits the cores among built-in replicas; give vLLM a count")
        from aaflow.planning.split import calibrate_splits, choose_split

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


def parse_engines(values: list[str]) -> tuple[str, dict[str, str]]:
    """`--engine` values ("vllm", or "MODEL=vllm" per model) -> (default engine, {model: engine})."""
    engine, engines = "builtin", {}
    for value in values:
        model, _, kind = value.rpartition("=")
        if kind not in ("builtin", "vllm"):
            raise SystemExit(f"aaflow: --engine {value!r}: the engine must be 'builtin' or 'vllm' "
                             "(for every model, or MODEL=vllm for one)")
        if model:
            engines[model] = kind
        else:
            engine = kind
    return engine, engines


def _hardware_name(name: str | None) -> str | None:
    """A profile name, path, or unique prefix of a shipped one ("a100" -> "a100-80gb")."""
    from costmodel.hardware import available_hardware

    if name is None or name in available_hardware() or name.endswith((".yaml", ".yml")):
        return name
    matches = [h for h in available_hardware() if h.startswith(name)]
    return matches[0] if len(matches) == 1 else name


def _plan(args) -> int:
    import json

    import aaflow as af

    wf = af.load_workflow(args.workflow)
    replicas = {a.model: args.replicas for a in wf.agents()}
    hardware = _hardware_name(args.hardware)
    cluster = None
    if hardware is None:
        from aaflow.calibration import covers, find_profile
        from aaflow.planning import replica_infos

        if not covers(find_profile(), replica_infos(replicas, args.dtype)):  # calibrating needs live replicas
            print(f"aaflow plan: this machine has no calibrated profile for {', '.join(replicas)} in {args.dtype} yet; "
                  "starting replicas to calibrate ...")
            cluster = af.init(replicas=replicas, dtype=args.dtype)
    try:
        plan = af.plan(wf, cluster or replicas, hardware=hardware, link=args.link, chunk_tokens=args.chunk_tokens,
                       dtype=args.dtype)
    finally:
        if cluster is not None:
            cluster.shutdown()
    print(plan.explain())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _breakeven(args) -> int:
    """Transfer vs recompute what-ifs for a model on a hardware profile."""
    from costmodel.hardware import load_hardware
    from costmodel.model_profile import model_profile
    from costmodel.units import format_bandwidth, format_seconds
    from costmodel.whatif import break_even_bandwidth, break_even_context, transfer_speedup

    hardware = _hardware_name(args.hardware)
    if hardware is None:
        from aaflow.calibration import find_profile

        profile = find_profile()
        if profile is None:
            print("aaflow breakeven: no calibrated profile here; run `aaflow calibrate` or pass --hardware NAME",
                  file=sys.stderr)
            return 2
    else:
        profile = load_hardware(hardware)
    model = model_profile(args.model)
    key = next((k for k in profile.compute if k.split("|")[0] == args.model), None)
    if key is not None:
        from dataclasses import replace

        model = replace(model, name=key)
    compute = profile.compute_for(model)
    label = "measured here" if profile.measured else "PROJECTION (public figures, not measured here)"
    print(f"{args.model} on {profile.name} ({label}); KV {model.kv_bytes_per_token:,} bytes/token")
    print(f"prefill of {args.context:,} tokens: {format_seconds(compute.prefill_time(args.context))}")
    print(f"break-even bandwidth at {args.context:,} tokens: "
          f"{format_bandwidth(break_even_bandwidth(model, compute, args.context))}")
    for name in args.link or sorted(profile.links):
        link = profile.link(name)
        context = break_even_context(model, compute, link)
        print(f"link {name}: transfer {format_seconds(link.transfer_time(args.context * model.kv_bytes_per_token))}, "
              f"{transfer_speedup(model, compute, link, args.context):.1f}x faster than prefill; transfer wins from "
              f"{f'{context:,} tokens' if context else 'no length up to 131,072 tokens'}")
    return 0


def _calibrate(args) -> int:
    from pathlib import Path

    import aaflow as af
    from aaflow.calibration import default_profile_name
    from costmodel.hardware import hardware_dir

    name = args.name or default_profile_name()
    out = Path(args.out) if args.out else hardware_dir() / f"{name}.yaml"
    cluster = af.init(replicas={args.model: args.replicas}, dtype=args.dtype)
    try:
        af.calibrate(cluster, name=name, quick=not args.full, out=out)
    finally:
        cluster.shutdown()
    return 0


def _fetch_model(args) -> int:
    from aaflow.models import fetch_model

    path = fetch_model(args.name, force=args.force)
    print(path)
    return 0


def _bench(args) -> int:
    if args.name == "all":
        for name, module_name in BENCHMARKS.items():
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

    demo = sub.add_parser("demo", help="a multi-agent review workflow on SmolLM2, two replicas, text vs auto")
    demo.add_argument("--workflow", default=None, help="a workflow YAML (default: the shipped review)")
    demo.add_argument("--replicas", type=int, default=2)
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
    run.add_argument("--replicas", type=_replicas_arg, default=2,
                     help="replicas per model, or auto: the split of this machine's cores the planner predicts "
                          "fastest for this workflow (built-in engine)")
    run.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    run.add_argument("--engine", action="append", default=[], metavar="[MODEL=]ENGINE",
                     help="builtin (default) or vllm, for every model or one: --engine smollm2=vllm (repeatable; "
                          "vLLM needs `bash benchmarks/setup_vllm_env.sh`)")
    run.add_argument("--deterministic", action="store_true",
                      help="batch- and chunk-invariant kernels: every strategy gives text's tokens in bf16 too "
                           "(built-in engine; decode up to 35%% slower)")
    run.add_argument("--kv-cache-bytes", default=None, metavar="SIZE",
                      help="KV pool per replica, e.g. 2GiB (default: 10%% of memory shared by the replicas, "
                           "or $AAFLOW_KV_CACHE_BYTES)")
    run.set_defaults(func=_run)

    plan = sub.add_parser("plan", help="the planner's strategy per edge and predicted times for a workflow YAML")
    plan.add_argument("workflow")
    plan.add_argument("--replicas", type=int, default=2, help="replicas per model")
    plan.add_argument("--hardware", default=None,
                      help="a hardware profile (a100-80gb, h100, h200, a YAML path) for a projection; "
                           "default: this machine's calibrated profile")
    plan.add_argument("--link", default=None, help="link between replicas: a profile link name or e.g. 25Gbps")
    plan.add_argument("--chunk-tokens", type=int, default=16)
    plan.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    plan.add_argument("--json", default=None, help="also write the plan as JSON here")
    plan.set_defaults(func=_plan)

    breakeven = sub.add_parser("breakeven", help="when KV transfer beats recomputing: break-even bandwidth and context")
    breakeven.add_argument("--model", default="smollm2", help="a known model (smollm2, llama-3-8b, qwen3-8b)")
    breakeven.add_argument("--hardware", default=None, help="a profile (default: this machine's calibrated one)")
    breakeven.add_argument("--context", type=int, default=4096)
    breakeven.add_argument("--link", nargs="*", default=None, help="links: profile names or bandwidths (25Gbps)")
    breakeven.set_defaults(func=_breakeven)

    calibrate = sub.add_parser("calibrate", help="measure this machine's replicas and links into a hardware profile")
    calibrate.add_argument("--model", default="smollm2")
    calibrate.add_argument("--replicas", type=int, default=2, help="two or more also measure the links")
    calibrate.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    calibrate.add_argument("--name", default=None, help="profile name (default local-<hostname>)")
    calibrate.add_argument("--out", default=None, help="YAML path (default configs/hardware/<name>.yaml)")
    calibrate.add_argument("--full", action="store_true", help="a longer grid (several minutes)")
    calibrate.set_defaults(func=_calibrate)

    fetch = sub.add_parser("fetch-model", help="fetch a registered model (e.g. smollm2) into the cache")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true", help="download and convert again")
    fetch.set_defaults(func=_fetch_model)

    from benchmarks import report as report_module

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

    from aaflow.cli_deploy import add_deploy_commands

    add_deploy_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from aaflow.errors import AAFlowError

    try:
        return args.func(args)
    except AAFlowError as exc:
        print(f"aaflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
