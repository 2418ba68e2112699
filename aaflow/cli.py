"""The `aaflow` command line: demo, fetch-model, bench."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

BENCHMARKS = {
    "engine": "benchmarks.engine_bench",
    "memory": "benchmarks.memory_bench",
    "transfer": "benchmarks.kv_transfer_bench",
    "compose": "benchmarks.compose_bench",
}

DEMO_QUESTION = "In two sentences, why do multi-agent LLM workflows waste compute re-reading shared context?"


def _demo(args) -> int:
    import torch

    from aaflow.engine import Engine

    torch.set_num_threads(args.threads)
    print(f"aaflow demo: loading {args.model} ({args.dtype}) with the built-in engine ...", flush=True)
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


def _fetch_model(args) -> int:
    from aaflow.models import fetch_model

    path = fetch_model(args.name, force=args.force)
    print(path)
    return 0


def _bench(args) -> int:
    module = importlib.import_module(BENCHMARKS[args.name])
    module.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aaflow", description="aaflow: a distributed KV-state workflow runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="load SmolLM2 with the built-in engine and answer a chat prompt")
    demo.add_argument("--model", default="smollm2")
    demo.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    demo.add_argument("--prompt", default=DEMO_QUESTION)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--threads", type=int, default=2)
    demo.set_defaults(func=_demo)

    fetch = sub.add_parser("fetch-model", help="fetch a registered model (e.g. smollm2) into the cache")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true", help="download and convert again")
    fetch.set_defaults(func=_fetch_model)

    bench = sub.add_parser("bench", help="run a benchmark; writes JSON under results/")
    bench_sub = bench.add_subparsers(dest="name", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(func=_bench)
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
