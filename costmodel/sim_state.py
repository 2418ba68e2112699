"""Mutable state of one simulation run: agents, replicas and their call queues (internal).

Mirrors `aaflow.runtime.executor`'s `_Agent` and its per-replica bookkeeping; the simulator in
`costmodel.simulate` drives it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from costmodel.hardware import ComputeProfile
    from costmodel.workflow_spec import AgentTask

STRATEGIES = ("text", "recompute", "transfer", "stream", "transfer+stream", "auto")
AUTO_MIN_SHARED_PREFIX = 64  # executor.AUTO_MIN_SHARED_PREFIX: "auto" shares a prefix as KV from this many tokens
BLOCK_TOKENS = 16  # the engine's KV block: the prefix cache serves whole blocks only


@dataclass
class SimAgent:
    """An agent's progress (the executor's `_Agent`, with token counts instead of ids)."""

    task: AgentTask
    strategy: str
    segments: list[int | str]  # [prefix tokens, *task.segments]
    consumers: list[str]
    replica: str | None = None
    state: str = "new"  # new -> opening -> open -> decoding -> done
    fed: int = 0  # prompt tokens sent to the replica
    seg: int = 0  # next segment to feed, and the offset inside it
    offset: int = 0
    decoded: int = 0  # tokens generated so far (= the executor's len(output): no end-of-sequence)
    busy: bool = False  # a prefill of this agent is queued or running
    session: bool = False  # its session is open on the replica
    kv_tokens: int = 0  # tokens the session's KV holds
    shared_tokens: int = 0  # of those, prefix tokens in blocks shared with other sessions or refs
    start_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    computed: int = 0
    reused: int = 0
    prefix_via: str = ""  # how its prefix arrived: "reuse", "transfer" or "recompute"

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def shares_prefix(self) -> bool:
        """Materializes/forks/transfers its static prefix as a KV object (executor.SHARES_PREFIX)."""
        s = self.strategy
        return s in ("transfer", "transfer+stream") or (s == "auto" and self.task.prefix_tokens >= AUTO_MIN_SHARED_PREFIX)

    @property
    def streams(self) -> bool:
        """Prefills upstream tokens while the upstream still decodes (executor.STREAMS)."""
        return self.strategy in ("stream", "transfer+stream", "auto")


@dataclass
class Call:
    """A queued replica call. `run` is evaluated when the call starts (the replica's state then
    decides e.g. prefix-cache hits) and returns (seconds, value); `then(value)` runs at its end."""

    kind: str  # open | prefill | chunk | transfer | close (the executor's kinds; "step" is launched directly)
    run: Callable[[], tuple[float, object]]
    then: Callable[[object], None] | None = None
    tokens: int = 0  # a prefill's prompt tokens (packing is capped by their sum)
    prefix_key: str = ""  # a prefill's agent's prefix (a pack's members may share it)
    shares: int = 0  # prompt tokens of a session's first prefill that other first prefills of its prefix share


@dataclass
class ReplicaState:
    """One replica: its FIFO call queue (one call in flight), prefix cache and shared prefix refs."""

    name: str
    model: str
    compute: ComputeProfile
    kv_bytes_per_token: int
    queue: deque[Call] = field(default_factory=deque)
    last_kind: str = ""
    busy_s: float = 0.0  # total seconds of calls run here
    cached: set[str] = field(default_factory=set)  # prefix keys whose full blocks the prefix cache holds
    refs: dict[str, int] = field(default_factory=dict)  # prefix key -> tokens of a shared prefix ref held here
    placed: list[SimAgent] = field(default_factory=list)  # agents placed here, in placement order

    def live_kv_bytes(self) -> int:
        """KV bytes held now: each open session's own tokens, plus each shared prefix once (a prefix
        ref, a forked prefix or prefix-cache blocks adopted by non-text sessions)."""
        own = 0
        shared: dict[str, int] = dict(self.refs)
        for a in self.placed:
            if not a.session:
                continue
            own += a.kv_tokens - a.shared_tokens
            if a.shared_tokens:
                key = a.task.prefix_key
                shared[key] = max(shared.get(key, 0), a.shared_tokens)
        return (own + sum(shared.values())) * self.kv_bytes_per_token


def cache_hit_tokens(prefix_tokens: int, new_tokens: int) -> int:
    """Tokens the prefix cache serves to an empty session prefilling `new_tokens` that start with a
    cached prefix: whole blocks of the prefix, leaving at least one token to compute (engine rule)."""
    return min(prefix_tokens // BLOCK_TOKENS, max(0, new_tokens - 1) // BLOCK_TOKENS) * BLOCK_TOKENS


class PrefixSharing:
    """The executor's prefix-sharing methods (`_with_prefix`, `_transfer_prefix`, `_prefix_ready`) for
    the simulator: materialize a static prefix once per model, fork it on the same replica, send it
    to others (expose on the source, receive on the destination, release). Needs the simulator's
    `replicas`, `prefix_refs`, `prefix_waiters`, `transferring`, `prefix_origin`, `link`,
    `memcpy_bytes_per_s`, `overhead`, the counters `computed` / `bytes_moved`, and `_call`, `_fixed`."""

    def _with_prefix(self, agent: SimAgent) -> None:
        key = (agent.task.model, agent.task.prefix_key)
        holders = self.prefix_refs.setdefault(key, {})
        rname = agent.replica
        if rname in holders:
            agent.prefix_via = agent.prefix_via or "reuse"
            self._call(rname, "open", self._fixed,
                       then=lambda _: self._opened(agent, prefix_len=agent.task.prefix_tokens))
            return
        waiting = self.prefix_waiters.setdefault(key + (rname,), [])
        waiting.append(agent)
        if len(waiting) > 1:
            return
        source = next((r for r in self.replicas if r in holders), None)
        if source is not None:
            self._transfer_prefix(key, source, rname, agent.task.prefix_tokens)
        elif key not in self.prefix_origin:  # compute it once; other replicas wait to receive it
            self.prefix_origin[key] = rname
            self._call(rname, "prefill", lambda: self._materialize_cost(rname, agent.task.prefix_key,
                                                                        agent.task.prefix_tokens),
                       then=lambda _: self._prefix_ready(key, rname, agent.task.prefix_tokens, received=False),
                       tokens=agent.task.prefix_tokens)

    def _materialize_cost(self, rname: str, prefix_key: str, prefix_tokens: int) -> tuple[float, None]:
        r = self.replicas[rname]
        hit = cache_hit_tokens(prefix_tokens, prefix_tokens) if prefix_key in r.cached else 0
        self.computed += prefix_tokens - hit
        return self.overhead + r.compute.prefill_time(prefix_tokens - hit, hit), None

    def _transfer_prefix(self, key: tuple[str, str], source: str, dest: str, prefix_tokens: int) -> None:
        tkey = key + (dest,)
        self.transferring.add(tkey)
        nbytes = prefix_tokens * self.replicas[dest].kv_bytes_per_token

        def received(_) -> None:
            self.transferring.discard(tkey)
            self._call(source, "transfer", self._fixed)  # release
            self.bytes_moved += nbytes
            self._prefix_ready(key, dest, prefix_tokens, received=True)

        def exposed(_) -> None:
            self._call(dest, "transfer", lambda: (self.overhead + self.link.transfer_time(nbytes), None),
                       then=received)

        self._call(source, "transfer",
                   lambda: (self.overhead + self.link.source_copy_time(nbytes, self.memcpy_bytes_per_s), None),
                   then=exposed)

    def _prefix_ready(self, key: tuple[str, str], rname: str, prefix_tokens: int, received: bool) -> None:
        self.prefix_refs.setdefault(key, {})[rname] = True
        r = self.replicas[rname]
        r.refs[key[1]] = prefix_tokens
        r.cached.add(key[1])
        for i, agent in enumerate(self.prefix_waiters.pop(key + (rname,), [])):
            agent.prefix_via = agent.prefix_via or ("transfer" if received else "recompute" if i == 0 else "reuse")
            self._with_prefix(agent)
        for wkey, waiters in list(self.prefix_waiters.items()):  # replicas waiting for this prefix
            if wkey[:-1] == key and waiters and wkey not in self.transferring:
                self._transfer_prefix(key, rname, waiters[0].replica, prefix_tokens)
