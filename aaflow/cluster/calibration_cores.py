"""How the replicas of one machine affect each other's compute, for `aaflow calibrate`: the
slowdown while two compute at once (`HardwareProfile.concurrency_slowdown`) and the speedup of a
prefill run on the threads of idle replicas (`lent_core_speedup`, `aaflow.runtime.core_lending`).
Both are timed inside the replicas."""

from __future__ import annotations

import statistics
from typing import Callable

from aaflow.runtime.core_lending import lent_threads
from aaflow.cluster.replica_calls import call, submit
from aaflow.runtime.probe_calls import CalibratePrefillCall, InfoCall


def say(progress: Callable[[str], None] | None, message: str) -> None:
    """Pass a progress line to `progress` (None: stay quiet)."""
    if progress is not None:
        progress(message)


def concurrency_slowdown(replicas, progress, attempts: int = 3, max_drift: float = 0.15) -> float:
    """How much slower a replica computes while another one computes too (>= 1): the same prefill
    alone, then on two replicas at once, then alone again, timed inside the replicas. A long prefill
    (2,048 tokens where the model allows) is used: contention for memory bandwidth grows with the
    working set, and long contexts are where the planner's choice between overlapping and waiting
    matters. On a shared machine whose speed drifts, the two solo timings disagree; then the
    measurement is repeated (up to `attempts` times) and the median estimate kept."""
    if len(replicas) < 2:
        return 1.0
    pair = replicas[:2]

    def alone(point):  # one replica at a time: [seconds per replica]
        return [call(r, CalibratePrefillCall(point, 1)) for r in pair]

    for tokens in (2048, 512):  # the longest prefill both pools can hold
        point = ((tokens, 0),)
        before = alone(point)
        if all(before):
            break
    else:
        return 1.0
    estimates = []
    for attempt in range(attempts):
        if attempt:
            before = alone(point)
        together = [f.result() for f in [submit(r, CalibratePrefillCall(point, 2)) for r in pair]]  # at once
        after = alone(point)
        seconds = [[replica[0][2] for replica in samples] for samples in (before, together, after)]
        estimate, drift = slowdown_estimate(*seconds)
        estimates.append(estimate)
        if drift <= max_drift:
            break
        say(progress, f"  this machine's speed drifted {drift:.0%} during the contention measurement; measuring again")
    slowdown = max(1.0, statistics.median(estimates))
    say(progress, f"  two replicas prefilling {tokens} tokens at once: {slowdown:.2f}x slower each")
    return slowdown


def slowdown_estimate(before: list[float], together: list[float], after: list[float]) -> tuple[float, float]:
    """Per-replica prefill seconds alone (before), at once (together), alone again (after) ->
    (mean of together / mean solo time, the largest relative change between the two solo timings)."""
    solo = [(b + a) / 2 for b, a in zip(before, after)]
    estimate = statistics.mean(t / s for t, s in zip(together, solo))
    drift = max(abs(b - a) / min(b, a) for b, a in zip(before, after))
    return estimate, drift


def lent_core_speedup(replicas, progress, tokens: int = 1024) -> float:
    """How much faster a `tokens`-token prefill runs on the first replica when the other built-in
    replicas of its node lend it their threads (>= 1): on its own threads, on the lent ones, on its
    own again, while the others idle; 1.0 when nothing can be lent."""
    if not replicas:
        return 1.0
    first = replicas[0]
    infos = {r.name: call(r, InfoCall()) for r in replicas}
    lent = lent_threads(first, replicas, infos, idle={r.name for r in replicas})
    if not lent:
        return 1.0
    own = infos[first.name]["threads"]
    point = ((tokens, 0),)

    def seconds(threads: int) -> float | None:
        samples = call(first, CalibratePrefillCall(point, 1, threads=0 if threads == own else threads))
        return samples[0][2] if samples else None

    before, on_lent, after = seconds(own), seconds(own + lent), seconds(own)
    if not (before and on_lent and after):
        return 1.0
    speedup = max(1.0, (before + after) / 2 / on_lent)
    say(progress, f"  a {tokens}-token prefill on {own + lent} threads ({lent} lent by idle replicas): "
                   f"{speedup:.2f}x faster")
    return speedup
