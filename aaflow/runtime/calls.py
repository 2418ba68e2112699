"""The calls a replica takes: one frozen dataclass per kind; what each answers is its `Reply`
(`aaflow.runtime.replies`).

A call names a `Replica` method (`kind.value`) and holds its arguments as named fields, in the
method's order; `arguments()` (and `keywords()`) is the one place that turns them into the method's
arguments. The call itself is what travels: a replica runs it with `Replica.run(call)` (the Ray
backend, `af.*` and calibration alike), the simulated clock predicts its duration. This module
holds the scheduler's calls; `af.*`'s and calibration's own are in `aaflow.runtime.operator_calls`
and `aaflow.runtime.probe_calls`. Prompt segments of several sessions travel as `PrefillRequest`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar, NamedTuple, Self, Sequence

from aaflow.runtime.replies import Exposure, MixedReply, PrefillReply, Received, RefRecord, StepsReply


class CallKind(Enum):
    """What a call does; the value is the replica method that does it."""

    OPEN = "session_open"  # OpenCall
    MATERIALIZE = "materialize"  # MaterializeCall
    COMPOSE = "compose"  # ComposeCall
    PREFILL = "session_prefill"  # PrefillCall
    PACK = "session_prefill_many"  # PackCall
    STEP = "session_step"  # StepCall
    STEPS = "session_steps"  # StepsCall (cluster.step_group_runner)
    MIXED = "session_step_mixed"  # MixedCall
    EXPOSE = "expose"  # ExposeCall
    RECEIVE = "receive"  # ReceiveCall
    RELEASE = "release"  # ReleaseCall
    CLOSE = "session_close"  # CloseCall
    FREE = "free"  # FreeCall
    EVICT = "evict"  # EvictCall
    FORK = "fork"  # ForkCall (aaflow.runtime.operator_calls)
    GENERATE = "generate"  # GenerateCall
    PIN = "pin"  # PinCall
    UNPIN = "unpin"  # UnpinCall
    INFO = "info"  # InfoCall (aaflow.runtime.probe_calls)
    STATS = "stats"  # StatsCall
    SESSION_COUNT = "session_count"  # SessionCountCall
    MEMCPY = "memcpy_bandwidth"  # MemcpyBandwidthCall
    CLEAR_PREFIX_CACHE = "clear_prefix_cache"  # ClearPrefixCacheCall
    CALIBRATE_PREFILL = "calibrate_prefill"  # CalibratePrefillCall
    CALIBRATE_DECODE = "calibrate_decode"  # CalibrateDecodeCall
    CALIBRATE_PACKING = "calibrate_packing"  # CalibratePackingCall
    CALIBRATE_RECEIVE = "calibrate_receive"  # CalibrateReceiveCall

    def __init__(self, method: str) -> None:
        # Plain attributes, not properties: the scheduler asks them of every call.
        # prefills: prefill calls, which a long prompt may speed up with lent threads
        self.prefills = method in ("materialize", "session_prefill", "session_prefill_many")
        # steps: calls that advance every decoding session of the replica by one token
        self.steps = method in ("session_step", "session_steps", "session_step_mixed")
        # computes: calls that run the model (they compete for the machine's cores)
        self.computes = self.prefills or self.steps or method == "compose"
        # transfers: calls of a prefix transfer between replicas
        self.transfers = method in ("expose", "receive", "release")
        # bookkeeping: calls that only open, close or free (about a millisecond, no model pass)
        self.bookkeeping = method in ("session_open", "session_close", "free", "evict")


class PrefillRequest(NamedTuple):
    """One session's prompt segment; `sampling` set when it completes the prompt (the answer then
    carries the first generated token), `reuse_prefix` lets the prefix cache serve it."""

    sid: str
    token_ids: list[int]
    sampling: object = None
    reuse_prefix: bool = True


@dataclass(frozen=True)
class Call:
    """One replica call; build one of its subclasses. Their positional fields are the replica
    method's arguments, in its order. `threads` > 0: run it on that many threads (idle replicas
    lend theirs). Each kind has `requests`, the prompt segments it carries: a field of PACK and
    MIXED, a property of PREFILL, () for the others (`NoPromptCall`). It is not declared here: a field
    declared here keeps its place before the subclass's fields, and a default would be inherited."""

    kind: ClassVar[CallKind]
    Reply: ClassVar[Any]  # the type of what the replica answers
    threads: int = field(default=0, kw_only=True)

    @property
    def method(self) -> str:
        """The replica method that runs the call."""
        return self.kind.value

    def arguments(self) -> tuple[Any, ...]:
        """The replica method's positional arguments: the positional fields (`threads` is not one)."""
        return tuple(getattr(self, name) for name in self.__match_args__)

    def keywords(self) -> dict[str, Any]:
        """The replica method's keyword arguments (none but where a call says so)."""
        return {}

    @property
    def sessions(self) -> list[str]:
        """The session ids the call works on."""
        return [r.sid for r in self.requests]

    @property
    def tokens(self) -> int:
        """Prompt tokens a prefill call computes at most (0 for other calls)."""
        return sum(len(r.token_ids) for r in self.requests)

    def with_threads(self, threads: int) -> Self:
        """The same call on `threads` threads."""
        return replace(self, threads=threads)


@dataclass(frozen=True)
class NoPromptCall(Call):
    """A call that carries no prompt segment."""

    requests: ClassVar[Sequence[PrefillRequest]] = ()


@dataclass(frozen=True)
class _OneSession(NoPromptCall):
    """A call on session `sid`."""

    sid: str

    @property
    def sessions(self) -> list[str]:
        return [self.sid]


@dataclass(frozen=True)
class _Decode(Call):
    """A call with a decode step of sessions `sids`."""

    sids: list[str]

    @property
    def sessions(self) -> list[str]:
        return list(self.sids) + [r.sid for r in self.requests]


@dataclass(frozen=True)
class OpenCall(_OneSession):
    """Open session `sid`, empty or continuing the ref `fork_of`."""

    kind = CallKind.OPEN
    Reply = int  # the session's length in tokens
    fork_of: str | None = None


@dataclass(frozen=True)
class MaterializeCall(NoPromptCall):
    """Prefill `token_ids` (or a text, from `af.materialize`) as a new KVRef (a shared prefix, or a
    part of a composed one); `lineage`: record how to rebuild it."""

    kind = CallKind.MATERIALIZE
    Reply = RefRecord
    token_ids: list[int] | str
    lineage: bool = True

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ComposeCall(NoPromptCall):
    """One new KVRef for the contexts of refs `ref_ids` in order (`mode`, `r`: `KVRunner.compose`)."""

    kind = CallKind.COMPOSE
    Reply = RefRecord
    ref_ids: list[str]
    mode: str
    r: float


@dataclass(frozen=True)
class PrefillCall(Call):
    """Append one prompt segment to session `sid` (the fields of a `PrefillRequest`)."""

    kind = CallKind.PREFILL
    Reply = PrefillReply
    sid: str
    token_ids: list[int]
    sampling: object = None
    reuse_prefix: bool = True

    @property
    def requests(self) -> list[PrefillRequest]:
        return [PrefillRequest(self.sid, self.token_ids, self.sampling, self.reuse_prefix)]


@dataclass(frozen=True)
class PackCall(Call):
    """Several sessions' prompt segments in one forward pass."""

    kind = CallKind.PACK
    Reply = list[PrefillReply]
    requests: list[PrefillRequest]


@dataclass(frozen=True)
class StepCall(_Decode, NoPromptCall):
    """One batched decode step of sessions `sids`."""

    kind = CallKind.STEP
    Reply = list[int]  # each session's new token


@dataclass(frozen=True)
class StepsCall(_Decode, NoPromptCall):
    """Up to `steps` decode steps of `sids` in one call; `stops`: a `StepStop` tuple per session."""

    kind = CallKind.STEPS
    Reply = StepsReply
    steps: int
    stops: list[tuple]


@dataclass(frozen=True)
class MixedCall(_Decode):
    """A decode step of `sids` and the prompt segments `requests` in one forward pass."""

    kind = CallKind.MIXED
    Reply = MixedReply
    requests: list[PrefillRequest]


@dataclass(frozen=True)
class ExposeCall(NoPromptCall):
    """Make ref `ref_id`'s blocks readable by another replica over `transport`."""

    kind = CallKind.EXPOSE
    Reply = Exposure
    ref_id: str
    transport: str


@dataclass(frozen=True)
class ReceiveCall(NoPromptCall):
    """Fetch the blocks another replica exposed (what its `ExposeCall` answered) as a new ref."""

    kind = CallKind.RECEIVE
    Reply = Received
    handle: Any
    shape: Any
    record: Any
    transport: str


@dataclass(frozen=True)
class ReleaseCall(NoPromptCall):
    """End the exposure `handle` (over `transport`)."""

    kind = CallKind.RELEASE
    Reply = None
    handle: Any
    transport: str


@dataclass(frozen=True)
class CloseCall(_OneSession):
    """Close session `sid` and free its KV."""

    kind = CallKind.CLOSE
    Reply = None


@dataclass(frozen=True)
class FreeCall(NoPromptCall):
    """Free ref `ref_id`."""

    kind = CallKind.FREE
    Reply = None
    ref_id: str


@dataclass(frozen=True)
class EvictCall(NoPromptCall):
    """Evict ref `ref_id`: its blocks leave the pool, the ref stays; its next use rebuilds it from
    its lineage (`aaflow.operators.evict`)."""

    kind = CallKind.EVICT
    Reply = None
    ref_id: str
    spill: bool | None = None
