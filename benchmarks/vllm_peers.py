"""vLLM engines kept loaded beside an aaflow cluster, so that a benchmark alternates their runs."""

from __future__ import annotations

from benchmarks.baseline_engines import faster_mode, start_vllm, vllm_specs
from benchmarks.common import wait_until_quiet
from benchmarks.vllm_subprocess import VllmError


class Peers:
    """vLLM engines kept loaded beside the aaflow cluster (`benchmarks.vllm_runner`), one per mode,
    so that each repeat of a workflow runs on vLLM right after it runs on aaflow: both sides see the
    machine in the same minutes. A mode that fails is dropped, its error kept."""

    def __init__(self, workflows: dict, modes: tuple[str, ...], timeout_s: float) -> None:
        self.runners, self.errors = {}, {}
        self.samples: dict[str, dict[str, list[float]]] = {}
        specs = vllm_specs(workflows)
        for mode in modes:
            try:
                self.runners[mode] = start_vllm(specs, mode, timeout_s)
                self.samples[mode] = {name: [] for name in workflows}
            except VllmError as exc:
                self.errors[mode] = str(exc)

    def warm(self, name: str) -> None:
        """One untimed run (a long-lived server has seen the workflow's shapes before)."""
        self._each(lambda mode, runner: runner.run(name))

    def run(self, name: str) -> None:
        """One timed run per mode, each once the cores are idle (`common.wait_until_quiet`)."""
        def timed(mode, runner) -> None:
            wait_until_quiet()
            self.samples[mode][name].append(runner.run(name))

        self._each(timed)

    def result(self) -> dict:
        """Per workflow the faster mode's median (`baseline_engines.faster_mode`), or the errors."""
        timed = {m: per for m, per in self.samples.items() if m not in self.errors and all(per.values())}
        return faster_mode(timed) if timed else {"error": "; ".join(f"{m}: {e}" for m, e in self.errors.items())}

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
