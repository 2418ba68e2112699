"""vLLM engines kept loaded beside an aaflow cluster, so that a benchmark alternates their runs."""

from __future__ import annotations

from aaflow.benchmarks.baseline_engines import fastest_config, start_vllm, vllm_specs
from aaflow.benchmarks.common import wait_until_quiet
from aaflow.benchmarks.vllm_subprocess import VllmError


class Peers:
    """vLLM engines kept loaded beside the aaflow cluster (`aaflow.benchmarks.vllm_runner`), one per
    configuration (`vllm_config.VllmConfig`: mode and KV block size), so that each repeat of a
    workflow runs on vLLM right after it runs on aaflow: both sides see the machine in the same
    minutes. A configuration that fails is dropped, its error kept."""

    def __init__(self, workflows: dict, configs: list, timeout_s: float) -> None:
        self.runners, self.errors, self.engines = {}, {}, {}
        self.samples: dict[str, dict[str, list[float]]] = {}
        specs = vllm_specs(workflows)
        for config in configs:
            try:
                self.runners[config.label] = start_vllm(specs, config, timeout_s)
                self.engines[config.label] = self.runners[config.label].facts
                self.samples[config.label] = {name: [] for name in workflows}
            except VllmError as exc:
                self.errors[config.label] = str(exc)

    def warm(self, name: str) -> None:
        """One untimed run (a long-lived server has seen the workflow's shapes before)."""
        self._each(lambda mode, runner: runner.run(name))

    def run(self, name: str) -> None:
        """One timed run per configuration, each once the cores are idle (`common.wait_until_quiet`)."""
        def timed(mode, runner) -> None:
            wait_until_quiet()
            self.samples[mode][name].append(runner.run(name))

        self._each(timed)

    def result(self) -> dict:
        """Per workflow the fastest configuration's median (`baseline_engines.fastest_config`), or the errors."""
        timed = {m: per for m, per in self.samples.items() if m not in self.errors and all(per.values())}
        return fastest_config(timed, self.engines) if timed else {"error": "; ".join(f"{m}: {e}" for m, e in self.errors.items())}

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()

    def _each(self, call) -> None:
        for mode, runner in list(self.runners.items()):
            try:
                call(mode, runner)
            except VllmError as exc:
                self.errors[mode] = str(exc)
                runner.close()
                del self.runners[mode]
