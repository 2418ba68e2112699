"""Placement: which live replica of its model an agent runs on.

The one with the least unfinished agents, preferring one that holds its prefix (as a shared
prefix, or where the last agent whose prompt began with the same `AFFINITY_TOKENS` went: the
replica's prefix cache, whether the prompt's document is its shared prefix or plain text) by 1.5 agents,
then one with room for its KV, and above all the one a transfer node names. A replica that holds
the prefix but is loaded loses the agent to an idle one; how the prefix gets there (moved, or
computed there) is then the cost model's call (`aaflow.runtime.prefix_costs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from aaflow.runtime.agent_state import AgentState

HOLDER_BONUS = 1.5  # agents of load a replica holding the prefix is worth
NO_ROOM = 10  # agents of load a replica without room for the agent's KV counts as
NAMED = 100  # agents of load the replica a transfer node names is worth
REMEMBERED = 4096  # prefixes whose last replica is remembered
AFFINITY_TOKENS = 256  # a prompt's leading tokens that name the prefix-cache entry it continues


class Placement:
    """Chooses replicas; remembers where each prefix last went (its prefix cache is likely there)."""

    def __init__(self) -> None:
        self.last_placed: dict[tuple, str] = {}  # affinity key -> the replica its last agent was placed on

    def choose(self, agent: AgentState, alive: list[str], load: dict[str, int], holders: dict[str, str],
               fits: Callable[[AgentState, str], bool]) -> str:
        """The replica for `agent` among `alive`, given each one's `load` (unfinished agents), the
        `holders` of its shared prefix and whether its KV `fits` there."""
        affinity = affinity_key(agent)
        cached = self.last_placed.get(affinity)
        best = min(alive, key=lambda r: load[r] - (HOLDER_BONUS if r in holders or r == cached else 0)
                   + (0 if fits(agent, r) else NO_ROOM) - (NAMED if r == agent.kv.replica else 0))
        if len(self.last_placed) > REMEMBERED:
            self.last_placed.clear()
        self.last_placed[affinity] = best
        return best


def affinity_key(agent: "AgentState") -> tuple:
    """Its model and the first `AFFINITY_TOKENS` of its prompt's leading static tokens (up to the
    first upstream answer): agents whose prompts begin alike find their tokens in one prefix cache."""
    ids: list[int] = []
    for segment in agent.segments:
        if not isinstance(segment, tuple):  # an upstream agent's answer: unknown at placement
            break
        ids.extend(segment[:AFFINITY_TOKENS - len(ids)])
        if len(ids) >= AFFINITY_TOKENS:
            break
    return agent.model, tuple(ids)
