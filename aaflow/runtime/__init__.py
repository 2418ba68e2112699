"""The core runtime: one scheduling loop per cluster (`service`) driving its replicas through a
backend (`backend`; Ray's is `aaflow.cluster.ray_backend`, the simulated clock's `sim_backend`). Runs reach
it through `aaflow.running` (`af.run`, `af.start`) or a deployment's actor.

Layer: core.
"""

from aaflow.runtime.prompt_setup import check_sizes, prompt_builders
from aaflow.runtime.recovery import AgentFailedError
from aaflow.runtime.results import AgentResult, RunResult
from aaflow.runtime.run_handle import RunCancelledError, RunHandle

__all__ = ["AgentFailedError", "AgentResult", "RunCancelledError", "RunHandle", "RunResult", "check_sizes",
           "prompt_builders"]
