"""Placement: which live replica of its model an agent runs on, by when it would be done there.

Each replica carries the predicted seconds of work of the unfinished agents placed on it (its
backlog: every agent's own prefill and decode tokens, and the shared prefixes computed there for
them, priced by the calibrated profile: `PrefixCosts`). An agent goes where its backlog plus the
cost of getting its prefix there is least:
* a replica that holds the prefix, computes it, or had the last agent reading it (its prefix cache
  or a fetch on its way) gets it for nothing;
* elsewhere, while some replica holds or computes it, the sooner of moving its KV there over the
  calibrated link and computing it there (the transfer operator or recomputation:
  `aaflow.runtime.prefix_sharing` asks the cost model again when it fetches);
* while none has it, its prefill, wherever it goes.
So a hot prefix's readers stay with it until its replica's queue outweighs a move, then spill to
the idle one, where it is moved (or computed) once and read by the readers after them: replicated
while its readers outnumber one replica's share. A replica without room for the agent's KV counts
as if ten of the agent were queued before it; the replica a transfer node names always wins.

Without a profile (nothing calibrated) every agent's work counts one unit and a prefix elsewhere 1.5
units: the least-loaded replica, preferring the prefix's holder by 1.5 agents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from aaflow.runtime.prompts import AgentInput

if TYPE_CHECKING:
    from aaflow.runtime.agent_state import AgentState
    from aaflow.runtime.prefix_costs import PrefixCosts

HOLDER_BONUS = 1.5  # without a profile: agents of load a replica holding the prefix is worth
NO_ROOM = 10  # times the agent's own work a replica without room for its KV counts as queued
REMEMBERED = 4096  # prefixes whose last replica is remembered


def predicted_tokens(agent: AgentState, max_tokens_of: Callable[[str], int]) -> tuple[int, int, int]:
    """(prefix, rest of the prompt, decode) tokens `agent` needs: an upstream agent's answer counted at
    its `max_tokens_of(name)`."""
    prefix = len(agent.segments[0]) if agent.segments else 0
    rest = sum(max_tokens_of(s.agent) if isinstance(s, AgentInput) else len(s) for s in agent.segments[1:])
    return prefix, rest, agent.max_tokens


class Placement:
    """Chooses replicas; keeps each replica's predicted backlog and where each prefix last went."""

    def __init__(self) -> None:
        self.last_placed: dict[tuple, str] = {}  # prefix key -> the replica its last agent was placed on
        self.backlog_s: dict[str, float] = {}  # replica -> predicted seconds of its unfinished agents' work
        self.charged: dict[str, tuple[str, float]] = {}  # agent -> (replica, seconds added to its backlog)

    def choose(self, agent: AgentState, alive: list[str], has_prefix: set[str], prefix_elsewhere: bool,
               fits: Callable[[AgentState, str], bool], costs: PrefixCosts | None,
               tokens: tuple[int, int, int]) -> str:
        """The replica for `agent` among `alive` (in cluster order, which breaks ties). `has_prefix`:
        the replicas holding or computing its shared prefix; `prefix_elsewhere`: some replica does
        (it can be moved); `tokens`: `predicted_tokens(agent)`. Its work is charged to the replica's
        backlog until `finished(agent)`."""
        self.finished(agent)  # placed again (restarted): its old charge goes
        prefix, rest, decode = tokens
        cached = self.last_placed.get(agent.prefix_key)
        profiled = costs is not None and agent.model in costs.compute
        if profiled:
            own = costs.agent_s(agent.model, prefix, rest, decode)
            computed = costs.compute_s(agent.model, prefix)
            moved = min(computed, costs.move_s(agent.model, prefix)) if agent.shares_prefix else computed
        else:
            own, computed, moved = 1.0, HOLDER_BONUS, HOLDER_BONUS

        def prefix_s(r: str) -> float:
            return 0.0 if r in has_prefix or r == cached else moved if prefix_elsewhere else computed

        def finish_s(r: str) -> float:
            return self.backlog_s.get(r, 0.0) + own + prefix_s(r) + (0.0 if fits(agent, r) else NO_ROOM * own)

        named = agent.kv.replica
        best = named if named in alive else min(alive, key=finish_s)
        charge = own + (prefix_s(best) if profiled else 0.0)  # unprofiled: a count of agents
        self.backlog_s[best] = self.backlog_s.get(best, 0.0) + charge
        self.charged[agent.name] = (best, charge)
        if len(self.last_placed) > REMEMBERED:
            self.last_placed.clear()
        self.last_placed[agent.prefix_key] = best
        return best

    def finished(self, agent: AgentState) -> None:
        """`agent` ended, was dropped or is placed again: its work leaves its replica's backlog."""
        replica, charge = self.charged.pop(agent.name, (None, 0.0))
        if replica is not None:
            self.backlog_s[replica] = max(0.0, self.backlog_s[replica] - charge)

    def emptied(self, replica: str) -> None:
        """`replica` died and came back empty: nothing is queued there."""
        self.backlog_s[replica] = 0.0
        self.charged = {name: c for name, c in self.charged.items() if c[0] != replica}
