"""A run inside the scheduling loop (`aaflow.runtime.service`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.results import RunResult
from aaflow.runtime.run_handle import RunHandle
from aaflow.runtime.run_options import RunOptions


@dataclass(eq=False)
class ServiceRun:
    """A run in the loop (`RunService`): what the client sent, and where the loop is with it."""

    id: str
    workflow: object
    agents: dict[str, AgentState]  # by their names in the loop (`<run>/<agent>`)
    builders: dict
    strategy: str
    events: list[str]
    on_token: object = None
    on_agent: object = None
    timeout_s: float | None = None
    planning_s: float = 0.0
    keep_prefix_s: float | None = None  # its shared prefixes are kept this long after it ends
    called: float = 0.0  # perf_counter when the client called
    options: RunOptions = field(default_factory=RunOptions)  # its own chunk size, call time limit, ...
    handle: RunHandle = None
    start_s: float = 0.0  # loop time when the loop took it
    first_event: int = 0  # the loop's events from here on are its
    ended: bool = False
    closing: set | None = None  # replicas yet to answer the no-op close queued behind the run's last calls
    error: BaseException | None = None
    result: RunResult | None = field(default=None, repr=False)
