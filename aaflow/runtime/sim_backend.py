"""The scheduler's backend on a simulated clock: each call takes the time the calibrated hardware
profile predicts (`SimReplica`), nothing runs. The planner predicts a plan by running the real
scheduler on it.

On top of each replica's own costs: a call that computes while another replica computes runs
`concurrency_slowdown` times slower (they share the machine's cores), and a prefill on lent
threads up to `lent_core_speedup` times faster (that much with
every other replica's thread lent, in proportion with fewer). No early end-of-sequence: decode yields fresh token
ids, never an end token.
"""

from __future__ import annotations

import heapq
import itertools

from aaflow.runtime.backend import Backend, ReplicaInfo, Ticket
from aaflow.runtime.calls import (Call, CloseCall, ComposeCall, EvictCall, ExposeCall, FreeCall, MaterializeCall,
                                  MixedCall, OpenCall, PackCall, PrefillCall, ReceiveCall, ReleaseCall, StepCall,
                                  StepsCall)
from aaflow.runtime.prefix_costs import PrefixCosts
from aaflow.runtime.replies import MixedReply
from aaflow.runtime.sim_replica import SimReplica
from aaflow.common.strategies import DEFAULT_BLOCK_TOKENS

SIM_NODE = "simulated"  # every simulated replica shares one machine (its cores can be lent)


class SimBackend(Backend):
    """Replicas `(name, model)` with call costs from `hardware` and `models` (ModelProfiles)."""

    def __init__(self, replicas: list[tuple[str, str]], hardware, models: dict, link: str,
                 call_overhead_s: float, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.link, self.link_name, self.memcpy_bytes_per_s = hardware.link(link), link, hardware.memcpy_bytes_per_s
        self.costs = PrefixCosts.of(hardware, {model: models[model] for _, model in replicas}, link)
        self.infos = [ReplicaInfo(name, model, "builtin", SIM_NODE, 1) for name, model in replicas]
        self.sims = {name: SimReplica(name, hardware.compute_for(models[model]), models[model].kv_bytes_per_token,
                                      block_tokens, call_overhead_s) for name, model in replicas}
        self.slowdown, self.lent_speedup = hardware.concurrency_slowdown, hardware.lent_core_speedup
        self.clock = 0.0
        self.heap: list[tuple[float, int, Ticket]] = []
        self.pending: dict[Ticket, tuple[object, object]] = {}  # ticket -> (value, state change at its end)
        self.values: dict[Ticket, object] = {}
        self.busy_s = {name: 0.0 for name in self.sims}
        self.bytes_moved = self.peak_kv_bytes = 0
        self.computing = 0  # calls in flight that run the model
        self.kv_bytes = {name: 0 for name in self.sims}
        self._seq = itertools.count()
        self._token_ids = itertools.count(1 << 40)  # decoded ids: never a prompt's (synthetic prompts count from 0)
        self._ref_ids = itertools.count()

    def replicas(self) -> list[ReplicaInfo]:
        return list(self.infos)

    def default_transport(self) -> str:
        """The link calls are timed on (`ClusterSpec.link`): its name is the transport."""
        return self.link_name

    def prefix_costs(self) -> PrefixCosts:
        return self.costs

    def now(self) -> float:
        return self.clock

    def pause(self, seconds: float) -> None:
        self.clock += seconds

    def submit(self, replica: str, call: Call) -> Ticket:
        seconds, value, apply = self._outcome(self.sims[replica], call)
        if call.threads > 1:  # the profile's speedup is with every other replica's thread lent
            seconds /= 1 + (self.lent_speedup - 1) * (call.threads - 1) / max(1, len(self.infos) - 1)
        if call.kind.computes:
            if self.computing:
                seconds *= self.slowdown  # another replica of this machine computes at the same time
            self.computing += 1
        self.busy_s[replica] += seconds
        ticket = Ticket(next(self._seq), replica, call)
        heapq.heappush(self.heap, (self.clock + seconds, ticket.seq, ticket))
        self.pending[ticket] = (value, apply)
        return ticket

    def _outcome(self, sim: SimReplica, call: Call):
        """(seconds, value, state change at its end) of `call` on `sim`."""
        next_token = self._token_ids.__next__
        match call:
            case OpenCall():
                return sim.session_open(call.sid, call.fork_of)
            case MaterializeCall():
                return sim.materialize(call.token_ids, self._new_ref_id(sim))
            case PrefillCall() | PackCall():
                seconds, answers, apply = sim.prefill_many(call.requests, next_token)
                return seconds, answers[0] if isinstance(call, PrefillCall) else answers, apply
            case StepCall():
                return sim.step(call.sids, next_token)
            case StepsCall():
                return sim.steps(call.sids, call.steps, call.stops, next_token)
            case MixedCall():
                step_s, tokens, stepped = sim.step(call.sids, next_token)
                pack_s, answers, filled = sim.prefill_many(call.requests, next_token)
                # one forward pass: one call overhead, one fixed prefill term; the pack joins the step as
                # one more member
                compute = sim.compute
                seconds = step_s + pack_s - sim.overhead - compute.prefill_fixed_s + compute.prefill_s_per_member
                return seconds, MixedReply(tokens, answers), lambda: (stepped(), filled())
            case ComposeCall():
                return sim.compose(call.ref_ids, call.mode, call.r, self._new_ref_id(sim))
            case ExposeCall():
                return sim.expose(call.ref_id, self.link, self.memcpy_bytes_per_s)
            case ReceiveCall():
                self.bytes_moved += call.shape.nbytes
                return sim.receive(call.handle, call.shape, self._new_ref_id(sim), self.link)
            case CloseCall():
                return sim.session_close(call.sid)
            case FreeCall():
                return sim.free(call.ref_id)
            case EvictCall():  # its blocks stay counted: a later fork's rebuild is not simulated either
                return sim.overhead, None, None
            case ReleaseCall():
                return sim.overhead, None, None
        raise TypeError(f"no simulated cost for {type(call).__name__}")

    def _new_ref_id(self, sim: SimReplica) -> str:
        return f"{sim.name}/ref{next(self._ref_ids)}"

    def wait(self, tickets: list[Ticket], num_returns: int, timeout_s: float) -> list[Ticket]:
        """Advance the clock to the end of the earliest call (or, asked for all, of the last one);
        the calls that ended, in launch order when several end at once."""
        wanted = set(tickets)
        ended, others = [], []
        while len(ended) < num_returns and self.heap:
            entry = heapq.heappop(self.heap)
            (ended if entry[2] in wanted else others).append((entry[0], entry[2]))
        for end, ticket in others:
            heapq.heappush(self.heap, (end, ticket.seq, ticket))
        if not ended:
            return []
        self.clock = max(self.clock, ended[-1][0])  # popped in order of their ends
        done = [t for _, t in ended] if num_returns == 1 else sorted((t for _, t in ended), key=lambda t: t.seq)
        for ticket in done:
            self.computing -= ticket.call.kind.computes
            value, apply = self.pending.pop(ticket)
            if apply is not None:
                apply()
            self.values[ticket] = value
            self.kv_bytes[ticket.replica] = self.sims[ticket.replica].live_kv_bytes()
            self.peak_kv_bytes = max(self.peak_kv_bytes, sum(self.kv_bytes.values()))
        return done

    def result(self, ticket: Ticket):
        return self.values.pop(ticket)

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens computed on every replica, shared prefixes included."""
        return sum(sim.computed for sim in self.sims.values())
