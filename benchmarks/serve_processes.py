"""aaflow's side of `aaflow bench serve --processes N`: the load from N client processes on a deployment.

A loopback `ray start --head` (`benchmarks.ray_head`) holds an `af.up` deployment: the replica and
the deployment's scheduler actor, which every client's runs go to. Each of N client processes
(`python -m benchmarks.serve_processes`) connects with `af.connect`, rebuilds the load from its
parameters, and runs its share (workflow i in process i % N), one thread per workflow calling
`af.run` at its arrival offset from one wall-clock instant shared by all processes; it prints its
rows (`serve_load.run_threads`' figures, end times in seconds from that instant) as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from benchmarks.serve_load import run_threads

ROWS = "SERVE_ROWS "
START_DELAY_S = 20.0  # the clients' imports and `af.connect` happen before the shared start


def deployment(temp_dir, dtype: str, deterministic: bool, pool: dict):
    """A loopback Ray head with an `af.up` deployment of one SmolLM2 replica on it: (head, cluster)."""
    import aaflow as af
    from benchmarks.ray_head import start_head

    head = start_head(temp_dir)
    os.environ.update({k: v for k, v in head.env.items() if k.startswith("RAY_")})  # join it as its clients do
    try:
        cluster = af.up({"smollm2": 1}, address=head.address, dtype=dtype, deterministic=deterministic, **pool)
    except BaseException:
        head.stop()
        raise
    return head, cluster


def run_processes(head, load: dict, offsets: list[float], strategy: str, processes: int, sample=None) -> dict:
    """The load's workflows from `processes` client processes on the deployment at `head`; the
    same answer as `run_threads` (rows in workflow order, wall seconds)."""
    count = load["workflows"]
    begin = time.time() + START_DELAY_S
    clients = []
    for k in range(processes):
        indices = list(range(k, count, processes))
        args = {"address": head.address, "load": load, "indices": indices, "offsets": [offsets[i] for i in indices],
                "begin": begin, "strategy": strategy}
        clients.append((indices, subprocess.Popen([sys.executable, "-m", "benchmarks.serve_processes", json.dumps(args)],
                                                  env=head.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                  text=True)))
    while any(p.poll() is None for _, p in clients):
        if sample is not None and time.time() > begin:
            sample()
        time.sleep(0.2)
    rows: list[dict | None] = [None] * count
    for indices, proc in clients:
        out, err = proc.communicate()
        found = [line[len(ROWS):] for line in out.splitlines() if line.startswith(ROWS)]
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"serve client for workflows {indices} exited {proc.returncode}:\n{err[-2000:]}")
        for i, row in zip(indices, json.loads(found[-1])):
            rows[i] = row
    ends = [r["end_s"] for r in rows if r and "end_s" in r]
    return {"rows": rows, "wall_s": max(ends) if ends else time.time() - begin}


def _client(args: dict) -> list[dict]:
    import aaflow as af
    from benchmarks.serve_shapes import documents, serve_workflows

    load = args["load"]
    workflows = serve_workflows(load["workflows"], documents(load["documents"], load["doc_tokens"]),
                                load["max_tokens"], load["ignore_eos"])
    cluster = af.connect(args["address"])
    try:
        begin = time.perf_counter() + (args["begin"] - time.time())  # the shared instant on this clock
        out = run_threads(cluster, [workflows[i] for i in args["indices"]], args["offsets"], args["strategy"],
                          begin=begin)
    finally:
        cluster.shutdown()
    for row in out["rows"]:
        if row and "end_s" in row:
            row["end_s"] -= begin
    return out["rows"]


if __name__ == "__main__":  # one client process: its arguments as one JSON word (see `run_processes`)
    print(ROWS + json.dumps(_client(json.loads(sys.argv[1]))), flush=True)
