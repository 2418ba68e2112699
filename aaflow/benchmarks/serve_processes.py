"""aaflow's side of `aaflow bench serve --processes N`: the load from N client processes on a deployment.

A loopback `ray start --head` (`aaflow.benchmarks.ray_head`) holds an `af.up` deployment: the replica and
the deployment's scheduler actor, which every client's runs go to. Each of N client processes
(`python -m aaflow.benchmarks.serve_processes`) connects with `af.connect`, rebuilds the load from its
parameters, and runs its share (workflow i in process i % N), one thread per workflow calling
`af.run` at its arrival offset from one wall-clock instant shared by all processes; it prints its
rows (`serve_load.run_threads`' figures, end times in seconds from that instant) as JSON.

The shared instant is set only once every client has imported aaflow and connected (each says
READY, then reads the instant from its stdin): a client that started late would otherwise submit
late, and the load's wall time would count its start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from aaflow.benchmarks.serve_load import run_threads

ROWS = "SERVE_ROWS "
READY = "SERVE_READY"
START_DELAY_S = 1.0  # from the last client's READY to the shared start
READY_TIMEOUT_S = 300.0


def deployment(temp_dir, dtype: str, deterministic: bool, pool: dict, replicas: int = 1):
    """A loopback Ray head with an `af.up` deployment of `replicas` SmolLM2 replicas on it: (head, cluster)."""
    import aaflow as af
    from aaflow.benchmarks.ray_head import start_head

    head = start_head(temp_dir)
    # join it as its clients do; the auth mode is left to `af.up` (Ray caches it at import: set in os.environ
    # afterwards, it reads as a mode the user chose and is not refreshed)
    os.environ.update({k: v for k, v in head.env.items() if k.startswith("RAY_") and k != "RAY_AUTH_MODE"})
    try:
        cluster = af.up({"smollm2": replicas}, address=head.address, dtype=dtype, deterministic=deterministic, **pool)
    except BaseException:
        head.stop()
        raise
    return head, cluster


def run_processes(head, load: dict, offsets: list[float], strategy: str, processes: int, sample=None) -> dict:
    """The load's workflows from `processes` client processes on the deployment at `head`; the
    same answer as `run_threads` (rows in workflow order, wall seconds)."""
    count = load["workflows"]
    clients = []
    for k in range(processes):
        indices = list(range(k, count, processes))
        args = {"address": head.address, "load": load, "indices": indices, "offsets": [offsets[i] for i in indices],
                "strategy": strategy}
        err = tempfile.TemporaryFile("w+")  # a pipe nobody reads during the load could fill
        proc = subprocess.Popen([sys.executable, "-m", "aaflow.benchmarks.serve_processes", json.dumps(args)], env=head.env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        proc.err = err
        clients.append((indices, proc))
    for indices, proc in clients:
        _wait_ready(proc, indices)
    begin = time.time() + START_DELAY_S
    for _, proc in clients:
        proc.stdin.write(f"{begin!r}\n")
        proc.stdin.close()
    while any(p.poll() is None for _, p in clients):
        if sample is not None and time.time() > begin:
            sample()
        time.sleep(0.2)
    rows: list[dict | None] = [None] * count
    for indices, proc in clients:
        out, err = proc.stdout.read(), _stderr(proc)
        proc.wait()
        found = [line[len(ROWS):] for line in out.splitlines() if line.startswith(ROWS)]
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"serve client for workflows {indices} exited {proc.returncode}:\n{err[-2000:]}")
        for i, row in zip(indices, json.loads(found[-1])):
            rows[i] = row
    ends = [r["end_s"] for r in rows if r and "end_s" in r]
    return {"rows": rows, "wall_s": max(ends) if ends else time.time() - begin}


def _wait_ready(proc: subprocess.Popen, indices: list[int]) -> None:
    """Until the client says READY; raises with its stderr if it exits first or takes too long."""
    deadline = time.time() + READY_TIMEOUT_S
    for line in proc.stdout:
        if line.startswith(READY):
            return
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"serve client for workflows {indices} was not ready (exit {proc.wait()}):\n"
                       f"{_stderr(proc)[-2000:]}")


def _stderr(proc: subprocess.Popen) -> str:
    """What a client wrote to its stderr."""
    proc.err.seek(0)
    return proc.err.read()


def _client(args: dict) -> list[dict]:
    import aaflow as af
    from aaflow.benchmarks.serve_shapes import documents, serve_workflows

    load = args["load"]
    workflows = serve_workflows(load["workflows"], documents(load["documents"], load["doc_tokens"]),
                                load["max_tokens"], load["ignore_eos"], load.get("hot", 0))
    cluster = af.connect(args["address"])
    try:
        print(READY, flush=True)
        shared = float(sys.stdin.readline())
        begin = time.perf_counter() + (shared - time.time())  # the shared instant on this clock
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
