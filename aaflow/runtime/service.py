"""One scheduling loop for every run on a cluster's replicas, whichever client submitted it.

A `RunService` owns one `Scheduler` and the thread that drives it. `submit` (from any thread) hands
it a run's agents and returns a `RunHandle` at once; the loop takes new runs between two replica
calls, so their agents are placed, admitted and batched with everything that runs already: one
decode step carries every decoding agent of every run on a replica, queued prompt segments of
different runs pack into one pass, KV is reserved across all runs, and the replicas' prefix cache
and shared prefixes serve a document many runs read (a shared prefix is freed once no pending agent
of any run reads it). Agents are named `<run>/<agent>` inside the loop; results keep the
workflow's names and count times from the run's arrival.

Each run brings its own options (`RunOptions`: chunk size, call time limit, transport, core
lending), carried by its agents: a cluster has this one loop whatever its runs ask for, so runs with
different options still share one KV reservation and one decode batch.

A run that fails (one of its agents failed), is cancelled or passes its `timeout_s` ends alone
(`Scheduler.drop`): its sessions close, its queued work goes, the other runs go on. A replica call
that outlasts a run's `call_timeout_s` fails the runs whose agents wait on that replica.
Replica deaths and KV shortages are handled as in a single run (`Recovery`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

from aaflow.common.errors import AAFlowError
from aaflow.runtime.agent_state import AgentPhase, AgentState, namespaced
from aaflow.runtime.executor import collect
from aaflow.runtime.recovery import AgentFailedError
from aaflow.runtime.run_handle import RunCancelledError, RunHandle
from aaflow.runtime.run_options import RunOptions
from aaflow.runtime.scheduler import AWAIT_POLL_S, Scheduler, Turn
from aaflow.runtime.service_run import ServiceRun

TICK_S = 0.5  # the longest the loop waits for a replica call before it looks at deadlines and cancels


class RunService:
    """The scheduling loop of a cluster: start it once, `submit` runs from any thread."""

    def __init__(self, backend) -> None:
        self.eos: dict[str, set[int]] = {}
        self.scheduler = Scheduler({}, backend, self.eos, on_token=self._on_token, on_done=self._on_done)
        self.runs: dict[str, ServiceRun] = {}
        self._owner: dict[str, ServiceRun] = {}  # loop name of an agent -> its run
        self._inbox: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._stopped = False
        self._closing = threading.Lock()  # a submit either reaches the loop or is refused once it stops
        self._raised: list[tuple[ServiceRun, BaseException]] = []  # runs whose callbacks raised, ended after the call
        self._progress_s = 0.0  # loop time a call last ended
        self.kept: dict[tuple, float] = {}  # shared prefix key -> loop time it is kept until (`keep_prefix_s`)
        self.cpu_s = 0.0  # CPU seconds the loop's thread has used (waiting on replicas uses none)
        self._thread = threading.Thread(target=self._serve, name="aaflow-scheduler", daemon=True)
        self._thread.start()

    def submit(self, workflow, agents: dict[str, AgentState], builders: dict, eos: dict[str, set[int]],
               strategy: str, events: list[str] | None = None, on_token=None, on_agent=None,
               timeout_s: float | None = None, planning_s: float = 0.0, called: float | None = None,
               keep_prefix_s: float | None = None, options: RunOptions | None = None) -> RunHandle:
        """Hand a run's agents (from `executor.workflow_agents`) to the loop; returns at once.
        `options` apply to this run alone. `planning_s` and `called` (`time.perf_counter()` when the
        client called) go to the result."""
        run_id = f"r{next(self._ids)}"
        options = options or RunOptions()
        for agent in agents.values():
            agent.options = options
        run = ServiceRun(run_id, workflow, namespaced(agents, run_id + "/"), builders, strategy, list(events or []),
                         on_token, on_agent, timeout_s, planning_s=planning_s, keep_prefix_s=keep_prefix_s,
                         called=time.perf_counter() if called is None else called, options=options)
        run.handle = RunHandle(self, run_id)
        with self._closing:
            if self._stopped:
                raise AAFlowError("this cluster's scheduler was stopped (the cluster was shut down)")
            self._inbox.put(("run", run, eos))
        return run.handle

    def stop(self) -> None:
        """End the loop; runs still in it fail with RunCancelledError."""
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        s = self.scheduler
        while not self._stopped:
            try:
                self._serve_once()
            except Exception as exc:  # noqa: BLE001 - a bug in the loop must not leave a client waiting
                self._fail_everything(exc)
        for run in list(self.runs.values()):
            if not run.ended:
                self._end(run, RunCancelledError(f"run {run.id}: the cluster's scheduler was stopped"))
        self._reap()
        with self._closing:  # runs sent while it stopped: refused, not left waiting
            while not self._inbox.empty():
                message = self._inbox.get()
                if message[0] == "run":
                    message[1].handle._end(None, RunCancelledError("the cluster's scheduler was stopped"))
        s.cleanup()

    def _serve_once(self) -> None:
        """Take new runs, launch and hand on one ended call, give ended runs their results."""
        s = self.scheduler
        due_s = self._release_kept()  # frees queue their calls: then the loop is not idle
        busy = bool(s.busy_replicas())
        awaiting = s.awaiting_replica() and not busy  # only a restarting replica to wait for
        idle = (not s.unfinished or awaiting) and not busy and not s.has_queued_calls()
        self._take(block=idle, timeout_s=min(due_s or AWAIT_POLL_S, AWAIT_POLL_S) if awaiting else due_s)
        if self._stopped:
            return
        try:
            self._turn()
        except AgentFailedError as exc:
            self._fail_agents(exc)
        except Exception as exc:  # noqa: BLE001 - a bug must not hang every client: fail them all
            for run in [r for r in self.runs.values() if not r.ended]:
                self._end(run, exc)
        for run, exc in self._raised:  # a client's callback raised: its run ends, the others go on
            if not run.ended:
                self._end(run, exc)
        self._raised.clear()
        self._reap()
        self.cpu_s = time.thread_time()

    def _fail_everything(self, exc: Exception) -> None:
        """A bug outside a replica call's handling (taking a run, handing results): every run fails
        with it at once, its handle resolved even where closing its sessions fails too; the loop
        goes on for the runs that come later."""
        for run in list(self.runs.values()):
            try:
                if not run.ended:
                    self._end(run, exc)
            except Exception:  # noqa: BLE001 - the handle below is what the client waits on
                pass
            run.handle._end(None, exc)
        self.runs.clear()
        self._owner.clear()

    def _turn(self) -> None:
        """One turn of the scheduler (`Scheduler.turn`); end runs that cannot progress or whose
        call time limit passed, and those past their deadline."""
        s = self.scheduler
        if not s.busy_replicas():  # the time limit counts from the first call after a pause
            self._progress_s = s.now()
        turn = s.turn(TICK_S)
        if turn is Turn.STALLED:
            for run in [r for r in self.runs.values() if not r.ended] if s.unfinished else []:
                self._end(run, AgentFailedError(f"workflow {run.workflow.name!r} cannot progress: its agents "
                                                "wait for inputs that never come"))
            return
        if turn is Turn.RAN:
            self._progress_s = s.now()
        elif turn is Turn.TIMED_OUT:
            self._fail_late_runs(s.now() - self._progress_s)
        self._check_deadlines()

    def _fail_late_runs(self, waited_s: float) -> None:
        """No call ended for `waited_s`: the runs whose `call_timeout_s` that passes fail, each
        alone, naming their agents on the replicas that did not answer (the others wait on)."""
        late = self.scheduler.busy_replicas()
        for run in [r for r in self.runs.values() if not r.ended and waited_s > r.options.call_timeout_s]:
            stuck = [a.name for a in run.agents.values() if a.state != AgentPhase.DONE and a.replica in late]
            if stuck:
                self._fail_agents(AgentFailedError(f"replicas {sorted(late)} did not answer within "
                                                   f"{run.options.call_timeout_s:.0f} s", stuck))

    def _release_kept(self) -> float | None:
        """Free the kept prefixes whose time is up, or all of them while an agent waits for KV room
        (a keep only uses room nobody wants), that no pending agent reads; the seconds until the
        next one is due (None: nothing kept)."""
        now = self.scheduler.now()
        due = set(self.kept) if self.scheduler.room_wanted() else {k for k, until in self.kept.items() if until <= now}
        for key in due:
            del self.kept[key]
        self.scheduler.free_prefixes(due)
        return min(self.kept.values()) - now if self.kept else None

    def _take(self, block: bool, timeout_s: float | None = None) -> None:
        """Take what clients sent: new runs join the scheduler, cancels end runs (waiting up to
        `timeout_s` for the first message when `block`)."""
        while True:
            try:
                message = self._inbox.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return
            block = False
            if message[0] == "stop":
                with self._closing:
                    self._stopped = True
                return
            if message[0] == "cancel":
                run = self.runs.get(message[1])
                if run is not None and not run.ended:
                    self._end(run, RunCancelledError(f"run {run.id} ({run.workflow.name!r}) was cancelled"))
                continue
            _, run, eos = message
            self.eos.update(eos)
            run.start_s, run.first_event = self.scheduler.now(), len(self.scheduler.events)
            self.runs[run.id] = run
            self._owner.update({name: run for name in run.agents})
            try:
                self.scheduler.add(run.agents)
            except AgentFailedError as exc:
                self._fail_agents(exc)

    def _check_deadlines(self) -> None:
        now = self.scheduler.now()
        for run in list(self.runs.values()):
            if not run.ended and run.timeout_s is not None and now - run.start_s > run.timeout_s:
                self._end(run, RunCancelledError(f"run {run.id} ({run.workflow.name!r}) passed its timeout of "
                                                 f"{run.timeout_s:g} s"))

    def _fail_agents(self, exc: AgentFailedError) -> None:
        """End the runs of the agents `exc` names (every unended run if it names none)."""
        runs = {id(r): r for r in (self._owner.get(name) for name in exc.agents) if r is not None}
        for run in runs.values() or [r for r in self.runs.values() if not r.ended]:
            if not run.ended:
                tag = run.id + "/"
                mine = [name.removeprefix(tag) for name in exc.agents if name.startswith(tag)]
                error = AgentFailedError(f"workflow {run.workflow.name!r}: " + str(exc).replace(tag, ""), mine)
                error.__cause__ = exc.__cause__
                self._end(run, error)

    def _end(self, run: ServiceRun, error: BaseException) -> None:
        """A run failed or was cancelled: drop its agents, free its shared prefixes."""
        agents = list(run.agents.values())
        self.scheduler.drop(agents)
        self.scheduler.free_prefixes(_prefixes_of(agents))
        run.ended, run.error = True, error

    def _reap(self) -> None:
        """Hand ended runs their results once the replicas ran their closes and frees; forget them."""
        s = self.scheduler
        for run in list(self.runs.values()):
            if not run.ended and all(a.state == AgentPhase.DONE for a in run.agents.values()):
                agents = list(run.agents.values())
                self._keep(run)
                s.free_prefixes(_prefixes_of(agents, self.kept))
                end = max((a.end_s for a in agents), default=s.now())
                shared = s.take_shared_computed(run.agents)
                run.result = collect(run.workflow, run.agents, run.builders, run.strategy, end - run.start_s,
                                     [], shared, start_s=run.start_s, prefix=run.id + "/")
                run.ended = True
            if run.ended and s.free_prefixes(_prefixes_of(run.agents.values(), self.kept)):
                run.closing = None  # a prefix it asked for arrived since: close again behind its free
            if run.ended and run.closing is None:  # a no-op call behind its closes and frees on each replica
                run.closing = left = set()  # the replicas that have not run it yet
                left.update(s.after_queued_calls(f"{run.id}/closed", left.discard))
            if run.ended and not {r for r in run.closing if not s.is_dead(r)}:
                del self.runs[run.id]
                try:
                    for name in run.agents:
                        self._owner.pop(name, None)
                    s.take_shared_computed(run.agents)
                    s.forget(list(run.agents.values()))
                    if run.result is not None:  # the loop's events while it ran (other runs' among them)
                        run.result.events = run.events + s.events[run.first_event:]
                        run.result.planning_s, run.result.total_s = run.planning_s, time.perf_counter() - run.called
                except Exception as exc:  # a bug: the run fails with it rather than wait forever
                    run.handle._end(None, exc)
                    raise
                run.handle._end(run.result, run.error)
        if not self.runs:  # nothing pending anywhere: no shared prefix has a reader left
            s.forget_prefixes(set(self.kept))
            if len(s.events) > 10_000:
                s.events.clear()

    def _keep(self, run: ServiceRun) -> None:
        """Its shared prefixes are kept `keep_prefix_s` from now (the longest of every run's keep)."""
        if run.keep_prefix_s:
            until = self.scheduler.now() + run.keep_prefix_s
            held = self.scheduler.held_prefixes()
            for key in {a.prefix_key for a in run.agents.values() if a.prefix_key in held}:
                self.kept[key] = max(until, self.kept.get(key, 0.0))

    def _on_token(self, name: str, token: int) -> None:
        run = self._owner.get(name)
        if run is not None and run.on_token is not None:
            self._call_client(run, run.on_token, name.removeprefix(run.id + "/"), token)

    def _on_done(self, name: str) -> None:
        run = self._owner.get(name)
        if run is not None and run.on_agent is not None:
            agent = run.agents[name]
            text = run.builders[agent.model].tokenizer.decode(agent.output, skip_special_tokens=True)
            self._call_client(run, run.on_agent, name.removeprefix(run.id + "/"), text)

    def _call_client(self, run: ServiceRun, callback, *args) -> None:
        """Call the client's code; if it raises, its run fails with that (after the replica call)."""
        try:
            callback(*args)
        except Exception as exc:  # noqa: BLE001 - the client's code
            self._raised.append((run, exc))


def _prefixes_of(agents, kept=()) -> set:
    """The shared prefixes `agents` forked, but those in `kept`."""
    return {a.prefix_key for a in agents if a.prefix_key not in kept}
