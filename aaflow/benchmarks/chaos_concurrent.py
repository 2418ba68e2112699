"""`aaflow bench chaos --concurrent N`: rounds of N workflows in flight at once on the cluster's one
scheduling loop (each its own client handle, `af.start`) while replicas are killed, and one client
per round walks away midway (`RunHandle.cancel`, as a client that dies does through its lease).

Checked per round: every other workflow completes with `text`'s tokens; the cancelled one ends with
`RunCancelledError`. After the rounds `chaos_bench` checks that every pool and the object store
are empty.
"""

from __future__ import annotations

import random
import threading
import time

from aaflow.benchmarks.common import log

STRATEGIES = ("text", "stream", "auto")


def concurrent_rounds(cluster, workflows: dict, expected: dict, killer, clients: int, rounds: int,
                      min_kills: int, call_timeout_s: float, seed: int, tally: dict) -> None:
    """Run the rounds (more, up to 3x, until `min_kills` kills), counting into `tally`: runs,
    identical, failures, cancelled, longest_run_s."""
    import aaflow as af

    rng, names = random.Random(seed), list(workflows)
    tally.setdefault("cancelled", 0)
    r = 0
    while r < rounds or (len(killer.kills) < min_kills and r < 3 * rounds):
        killer.new_run()
        t0 = time.perf_counter()
        handles = [(names[i % len(names)], af.start(workflows[names[i % len(names)]], cluster,
                                                    strategy=STRATEGIES[(i + r) % len(STRATEGIES)],
                                                    call_timeout_s=call_timeout_s)) for i in range(clients)]
        quitter = rng.randrange(clients)
        leaving = threading.Timer(rng.uniform(0.5, 3.0), handles[quitter][1].cancel)
        leaving.start()
        for i, (name, handle) in enumerate(handles):
            try:
                res = handle.result()
            except af.RunCancelledError as exc:
                if i == quitter:
                    tally["cancelled"] += 1
                else:
                    tally["failures"].append(f"round {r} {name}: cancelled: {exc}"[:400])
                continue
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                tally["failures"].append(f"round {r} {name}: {type(exc).__name__}: {exc}"[:400])
                continue
            finally:
                tally["runs"] += 1
            tally["identical"] += {n: a.token_ids for n, a in res.agents.items()} == expected[name]
        leaving.cancel()
        killer.armed.clear()
        tally["longest_run_s"] = max(tally["longest_run_s"], time.perf_counter() - t0)
        r += 1
        log(f"concurrent round {r}: {clients} workflows (up to 4 kills a round), {len(killer.kills)} kills so far, "
            f"{tally['identical']}/{tally['runs']} identical, {tally['cancelled']} cancelled")
