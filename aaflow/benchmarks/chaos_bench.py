"""`aaflow bench chaos`: workflows run while replica processes are killed at random moments.

A cluster of `--replicas` replicas (fp32: every strategy gives `text`'s tokens exactly) that Ray
restarts when their process dies runs the chain, fan-out, map-reduce and A->B workflows round
after round under `text`, `stream` and `transfer` over each KV transport (`ray`, `nixl`, `ucx`,
where installed), while a killer thread SIGKILLs a random replica process of this cluster at a
random moment (at most `replicas - 1` per run, so one replica always lives). The process title
says what the replica was doing when it died (`ray::ModelReplica.session_step`: a decode step,
`.materialize`: a shared prefix, `.expose` / `.receive`: either side of a transfer, ...).
Then `--targeted-rounds` rounds aim the kills: before each run every replica is armed to SIGKILL
itself when a call reaches a chosen point, the first to get there only (`aaflow.cluster.faults`, kind
"kill", one claim file for all): a prefill or a
decode step (text, stream), the shared prefix's materialize, the transfer source as it exposes the
prefix or 0.2 s later while its peer receives, the destination as it starts to receive (transfer
over each transport); whether it fired is read from the replicas' process ids.
Checked: every run completes with `text`'s tokens within `--call-timeout-s` per call, and after
the last run every replica holds no session, no ref and no used block, and the object store no
object. Reported: kills by what was running / by target, runs, runs with identical output,
failures and the longest run. With `--concurrent N` the random-kill rounds run N workflows at once
instead, one of whose clients cancels midway (`aaflow.benchmarks.chaos_concurrent`).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import threading
import time

from aaflow.benchmarks.common import log, machine_facts, write_json
from aaflow.benchmarks.soak_bench import object_store_usage


def replica_processes() -> dict[int, str]:
    """pid -> process title of this driver's replica actors (descendants of this process only:
    another program's Ray on the same machine is never touched)."""
    import psutil

    found = {}
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title.startswith("ray::ModelReplica"):
            found[proc.pid] = title.split()[0]
    return found


class Killer:
    """Kills a random replica process every `interval` seconds (uniform 0.5x-1.5x) while armed, never one
    while another restarts, at most `per_run` per run (default: one fewer than the replicas)."""

    def __init__(self, replicas: int, interval_s: float, seed: int, per_run: int | None = None) -> None:
        self.replicas, self.interval_s, self.rng = replicas, interval_s, random.Random(seed)
        self.limit = replicas - 1 if per_run is None else per_run  # kills per run (one at a time either way)
        self.kills: list[str] = []  # the title of each process killed
        self.per_run = 0
        self.armed = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def new_run(self) -> None:
        self.per_run = 0
        self.armed.set()

    def _loop(self) -> None:
        while not self.stop.wait(self.interval_s * self.rng.uniform(0.5, 1.5)):
            if not self.armed.is_set() or self.per_run >= self.limit:
                continue
            alive = {pid: title for pid, title in replica_processes().items() if not title.endswith("__init__")}
            if len(alive) < self.replicas:  # one is restarting: never leave the run without a replica
                continue
            pid = self.rng.choice(sorted(alive))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append(alive[pid].removeprefix("ray::ModelReplica").lstrip(".") or "idle")
            self.per_run += 1


def _workflows(model: str, doc: str) -> dict:
    import aaflow as af

    chain = af.Workflow("chain")
    guide, prev = chain.context("guide", doc), None
    for name in ("plan", "draft", "edit"):
        prompt = [guide] + ([prev] if prev is not None else []) + [f"Step: {name}."]
        prev = chain.agent(name, model, prompt, max_tokens=10, ignore_eos=True)
    fan = af.Workflow("fan-out")
    d = fan.context("doc", doc)
    root = fan.agent("analyze", model, [d, "Analyze."], max_tokens=12, ignore_eos=True)
    for i in range(4):
        fan.agent(f"gen{i}", model, [d, root, f"Variant {i}."], max_tokens=8, ignore_eos=True)
    mr = af.Workflow("map-reduce")
    p = mr.context("paper", doc)
    revs = [mr.agent(f"r{i}", model, [p, f"Review aspect {i}."], max_tokens=10, ignore_eos=True) for i in range(3)]
    mr.agent("meta", model, [p, *revs, "Meta-review."], max_tokens=10, ignore_eos=True)
    ab = af.Workflow("a-b")
    g = ab.context("guide", doc)
    for i in range(3):
        a = ab.agent(f"A{i}", model, [f"Topic {i}: the ocean."], max_tokens=16, ignore_eos=True)
        ab.agent(f"B{i}", model, [g, a, "Rewrite it."], max_tokens=8, ignore_eos=True)
    return {"chain": chain, "fan_out": fan, "map_reduce": mr, "a_b": ab}


# Where a targeted kill strikes, per strategy: "expose+" kills the source 0.2 s after it exposed
# the prefix (its peer is receiving); "receive" kills the destination as it starts to fetch.
TARGETS = {"text": ("prefill", "step"), "stream": ("prefill", "step"),
           "transfer": ("materialize", "expose", "expose+", "receive")}


def chaos(cluster, model: str, doc: str, rounds: int, interval_s: float, seed: int, transports: list[str],
          call_timeout_s: float, min_kills: int = 0, targeted_rounds: int = 0, concurrent: int = 0) -> dict:
    """Run the rounds under the killer, more (up to 3x) until `min_kills` kills, then
    `targeted_rounds` rounds in which each run arms one random replica to kill itself at a point
    of TARGETS; returns the report (see the module docstring). With `concurrent`, the rounds
    are `aaflow.benchmarks.chaos_concurrent`'s: that many workflows in flight at once."""
    import aaflow as af

    workflows = _workflows(model, doc)
    expected = {name: {n: a.token_ids for n, a in af.run(wf, cluster, strategy="text").agents.items()}
                for name, wf in workflows.items()}
    plans = [("text", None), ("stream", None)] + [("transfer", t) for t in transports]
    killer = Killer(len(cluster.replicas()), interval_s, seed, per_run=4 if concurrent else None)
    killer.thread.start()
    tally = {"runs": 0, "identical": 0, "failures": [], "longest_run_s": 0.0}

    def run_one(name, wf, strategy, transport) -> None:
        t0 = time.perf_counter()
        try:
            res = af.run(wf, cluster, strategy=strategy, transport=transport, call_timeout_s=call_timeout_s)
            tally["identical"] += {n: a.token_ids for n, a in res.agents.items()} == expected[name]
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            tally["failures"].append(f"{name}/{strategy}/{transport}: {type(exc).__name__}: {exc}"[:400])
        tally["runs"] += 1
        tally["longest_run_s"] = max(tally["longest_run_s"], time.perf_counter() - t0)

    targeted: dict[str, dict] = {}
    turns: dict[tuple, int] = {}  # (strategy, transport) -> targeted runs so far: its points in turn
    try:
        if concurrent:
            from aaflow.benchmarks.chaos_concurrent import concurrent_rounds

            concurrent_rounds(cluster, workflows, expected, killer, concurrent, rounds, min_kills, call_timeout_s,
                              seed, tally)
        else:
            r = 0
            while r < rounds or (len(killer.kills) < min_kills and r < 3 * rounds):
                for name, wf in workflows.items():
                    killer.new_run()
                    run_one(name, wf, *plans[(r + len(name)) % len(plans)])
                    killer.armed.clear()
                r += 1
                log(f"chaos round {r}: {len(killer.kills)} kills so far, {tally['identical']}/{tally['runs']} identical")
        killer.stop.set()
        for t in range(targeted_rounds):
            for i, (name, wf) in enumerate(workflows.items()):
                strategy, transport = plans[(t + i) % len(plans)]
                turn = turns[(strategy, transport)] = turns.get((strategy, transport), -1) + 1
                point = TARGETS[strategy][turn % len(TARGETS[strategy])]
                fired = _armed_run(cluster, point, lambda: run_one(name, wf, strategy, transport))
                row = targeted.setdefault(f"{strategy}/{transport or '-'}/{point}", {"armed": 0, "fired": 0})
                row["armed"] += 1
                row["fired"] += fired
            log(f"targeted round {t + 1}: {sum(v['fired'] for v in targeted.values())} kills fired, "
                f"{tally['identical']}/{tally['runs']} identical")
    finally:
        killer.stop.set()
        killer.thread.join()
    return {**tally, "kills": len(killer.kills) + sum(v["fired"] for v in targeted.values()),
            "random_kills_by_call": {k: killer.kills.count(k) for k in sorted(set(killer.kills))},
            "targeted_kills": targeted, "leftover": leftover_kv(cluster), "object_store": _settled_object_store()}


def _settled_object_store() -> dict:
    """The object store once the driver has dropped what finished runs still reference (a run's
    transfer handles can sit in reference cycles until the collector runs) and Ray has freed it."""
    import gc

    gc.collect()
    time.sleep(1.0)
    return object_store_usage()


def _armed_run(cluster, point: str, run) -> bool:
    """Arm every replica to kill itself at `point`, the first to reach it only (a claim file: a
    random victim often lay off the run's path), run, disarm; whether one died."""
    import ray

    replicas = cluster.replicas()
    pids = [_pid(r) for r in replicas]
    at, delay = (point[:-1], 0.2) if point.endswith("+") else (point, 0.0)
    with tempfile.TemporaryDirectory(prefix="aaflow-chaos-") as folder:
        claim = os.path.join(folder, "struck")
        ray.get([r.actor.inject_fault.remote("kill", 1, at, delay, claim) for r in replicas], timeout=60)
        run()
        time.sleep(0.3)  # a delayed kill lands
        for r in replicas:
            try:
                ray.get(r.actor.clear_fault.remote(), timeout=120)
            except ray.exceptions.RayActorError:  # killed at the last moment: restarted disarmed
                pass
    return [_pid(r) for r in replicas] != pids


def _pid(replica, wait_s: float = 120.0) -> int:
    """The replica's process id, waiting while Ray restarts it."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ray.get(replica.actor.info.remote(), timeout=wait_s)["pid"]
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def leftover_kv(cluster, wait_s: float = 120.0) -> dict:
    """Sessions, refs and used blocks still held per replica (restarting ones are waited for)."""
    import ray

    out, deadline = {}, time.monotonic() + wait_s
    for r in cluster.replicas():
        while True:
            try:
                stats = ray.get(r.actor.stats.remote(), timeout=wait_s)
                sessions = ray.get(r.actor.session_count.remote(), timeout=wait_s)
                break
            except ray.exceptions.ActorUnavailableError:  # restarting after a kill
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        out[r.name] = {"sessions": sessions, "refs": stats["refs"], "used_blocks": stats["used_blocks"]}
    return out


def run(args) -> dict:
    import aaflow as af
    from aaflow.benchmarks.scaling_bench import context_text
    from aaflow.cluster.transports import available_transports

    if args.quick:
        args.rounds, args.targeted_rounds = 3, 2
    transports = [t for t in ("ray", "nixl", "ucx") if t in available_transports()]
    cluster = af.init(replicas={args.model: args.replicas}, dtype="float32", restarts=-1)
    try:
        report = chaos(cluster, args.model, context_text(args.doc_tokens), args.rounds, args.interval_s,
                       args.seed, transports, args.call_timeout_s, min_kills=args.min_kills,
                       targeted_rounds=args.targeted_rounds, concurrent=args.concurrent)
    finally:
        cluster.shutdown()
    report.update({"benchmark": "chaos", "machine": machine_facts(), "transports": transports,
                   "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")}})
    log(f"chaos: {report['kills']} kills (random {report['random_kills_by_call']}; targeted "
        f"{report['targeted_kills']}); {report['identical']}/{report['runs']} runs "
        f"identical to text, {len(report['failures'])} failed; longest run {report['longest_run_s']:.1f} s; "
        f"left over: {report['leftover']}; object store {report['object_store']}")
    write_json(args.out, report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="3 rounds")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8, help="each round runs the four workflows")
    p.add_argument("--interval-s", type=float, default=2.0, help="mean seconds between kills")
    p.add_argument("--doc-tokens", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-kills", type=int, default=20, help="more rounds (up to 3x) until this many kills")
    p.add_argument("--targeted-rounds", type=int, default=5,
                   help="then rounds whose every run arms a replica to kill itself at a chosen point "
                        "(prefill, decode step, shared-prefix materialize, transfer source / destination)")
    p.add_argument("--call-timeout-s", type=float, default=120.0)
    p.add_argument("--concurrent", type=int, default=0,
                   help="rounds of this many workflows in flight at once, one client cancelling midway")
    p.add_argument("--out", default="results/chaos.json")
