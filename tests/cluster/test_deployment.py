"""A long-lived deployment on a real `ray start --head` (loopback): connecting where none runs, two
client processes at once sharing the document's KV, a killed client's runs cancelled after its lease,
`up` twice refused, pins with a TTL under eviction pressure, Ray metrics read back from Prometheus,
and down. The README's deploy example, run as written: test_deployment_readme.py."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request

import pytest

import aaflow as af
from aaflow.benchmarks.ray_head import REPO, start_head
from tests.cluster.deployment_helpers import doc_blocks_tokens, workflow_yaml

LEASE_S = 6.0  # the deployment's client lease: a killed client's runs go within seconds
QUESTIONS = {"summary": "Summarize the document in one line.", "questions": "Ask two questions about it."}


def cli(head, *args, timeout=300, check=True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "aaflow.cli", *args], env=head.env, cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"aaflow {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    import ray

    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    # what Ray itself does before starting a local cluster: token auth on where a token exists
    # (ray start does the same for the head; aaflow/benchmarks/ray_head.py passes the mode to every client)
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    saved = os.environ.pop("RAY_ADDRESS", None)
    try:
        h = start_head(tmp_path_factory.mktemp("ray"))
    except RuntimeError as exc:
        pytest.skip(f"cannot start a Ray head with its dashboard (Ray Jobs) here: {exc}")
    yield h
    if ray.is_initialized():
        ray.shutdown()
    h.stop()
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


def test_connect_without_a_deployment_names_the_fix(head):
    with pytest.raises(af.DeploymentError, match="aaflow up --address"):
        af.connect(head.address)
    out = cli(head, "status", "--address", head.address, check=False)
    assert out.returncode == 2 and "no aaflow deployment" in out.stderr
    from aaflow.benchmarks.ray_head import free_ports

    with pytest.raises(af.DeploymentError, match="nothing answers at"):
        af.connect(f"127.0.0.1:{free_ports(1)[0]}")
    with pytest.raises(af.DeploymentError, match="no Ray address"):
        af.connect()  # and no RAY_ADDRESS


@pytest.fixture(scope="module")
def deployment(head, model):
    cli(head, "up", "--address", head.address, "--replicas", f"{model}=2", "--dtype", "float32", "--kv-cache-bytes", "1MiB",
        "--client-lease-s", str(LEASE_S))
    cluster = af.connect(head.address)
    yield cluster
    cluster.shutdown()
    cli(head, "down", "--address", head.address, check=False)


CLIENT = """
import json, sys
import aaflow as af
streamed = []
res = af.submit(sys.argv[1], sys.argv[2], strategy="recompute", on_token=lambda agent, tok: streamed.append(tok))
json.dump({"tokens": {n: a.token_ids for n, a in res.agents.items()}, "streamed": streamed,
           "metrics": res.metrics}, open(sys.argv[3], "w"))
"""


def test_two_clients_at_once_share_the_document_kv(head, deployment, model, tmp_path):
    paths = {}
    for name, question in QUESTIONS.items():
        (tmp_path / name).mkdir()
        paths[name] = workflow_yaml(tmp_path / name, name, model, {name: question})
    procs = {name: subprocess.Popen([sys.executable, "-c", CLIENT, path, head.address, str(tmp_path / f"{name}.json")],
                                    env=head.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, path in paths.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"client {name} failed:\n{out[-4000:]}"
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in paths}
    for name, path in paths.items():  # text's tokens (computed from scratch, after both)
        reference = af.run(af.load_workflow(path), deployment, strategy="text")
        assert results[name]["tokens"][name] == reference[name].token_ids, f"{name}: recompute vs text differ"
        assert results[name]["streamed"] == reference[name].token_ids, f"{name}: streamed tokens differ"
    reused = sorted((r["metrics"]["prefill_reused"], n) for n, r in results.items())
    doc = doc_blocks_tokens(model)
    assert reused[0][0] < doc <= reused[1][0], f"one client computes the document, the other reuses it: {reused}"
    later = af.submit(paths["summary"], deployment, strategy="recompute")
    assert later.metrics["prefill_reused"] >= doc and later["summary"].token_ids == results["summary"]["tokens"]["summary"]


LONG_CHAIN_CLIENT = """
import sys, threading
import aaflow as af
cluster = af.connect(sys.argv[1])
wf = af.Workflow("long-chain")  # 400 agents of 100 tokens each, one after the other: minutes of decoding
previous = wf.agent("a0", sys.argv[2], ["Tell a long story."], max_tokens=100, ignore_eos=True)
for i in range(1, 400):
    previous = wf.agent(f"a{i}", sys.argv[2], [previous, "Go on."], max_tokens=100, ignore_eos=True)
started = threading.Event()
handle = af.start(wf, cluster, strategy="text", on_token=lambda agent, tok: started.set())
started.wait(120)
print("decoding", flush=True)
threading.Event().wait()  # until killed
"""


def test_a_killed_client_process_has_its_runs_cancelled_and_kv_freed(head, deployment, model):
    """A client process that dies mid-run stops polling: after the lease its run is cancelled (the
    replicas stop working on it), every replica holds no session and no more KV than before, and the
    deployment serves the next client."""
    held = sum(r["kv_bytes_held"] for r in af.status(deployment))
    client = subprocess.Popen([sys.executable, "-c", LONG_CHAIN_CLIENT, head.address, model], env=head.env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = []  # Ray's own log lines come first
        while not said or said[-1] not in ("decoding\n", ""):
            said.append(client.stdout.readline())
        assert said[-1] == "decoding\n", "".join(said)[-3000:]
        assert sum(row["queue_depth"] for row in af.status(deployment)) >= 1
    finally:
        client.kill()
        client.wait(timeout=30)
    deadline = time.monotonic() + 4 * LEASE_S
    rows = af.status(deployment)
    while time.monotonic() < deadline and any(r["queue_depth"] for r in rows):
        time.sleep(0.5)
        rows = af.status(deployment)
    assert all(r["queue_depth"] == 0 for r in rows), f"the dead client's run still has sessions: {rows}"
    time.sleep(1.0)
    later = af.status(deployment)
    busy = [(r["busy_s"], r["calls"]) for r in rows], [(r["busy_s"], r["calls"]) for r in later]
    assert busy[0] == busy[1], f"the replicas still work on the dead client's run: {busy}"
    assert sum(r["kv_bytes_held"] for r in later) <= held, later
    wf = af.Workflow("after")
    wf.agent("z", model, ["Still serving?"], max_tokens=4, ignore_eos=True)
    assert len(af.run(wf, deployment, strategy="text")["z"].token_ids) == 4


def test_up_twice_is_refused(head, deployment, model):
    out = cli(head, "up", "--address", head.address, "--replicas", f"{model}=1", check=False)
    assert out.returncode == 2 and "already runs" in out.stderr


def _pressure(cluster, model, replica, rounds: int = 10, tokens: int = 400) -> None:
    """Cycle more blocks than the pool holds through each replica (materialize, free)."""
    rng = random.Random(rounds)
    for _ in range(rounds):
        kv = af.materialize(cluster, model, [rng.randrange(256) for _ in range(tokens)], replica=replica)
        af.free(kv)


def _computed_again(cluster, model, ids, replica) -> int:
    kv = af.materialize(cluster, model, ids, replica=replica)
    af.free(kv)
    return kv.record.computed


def test_pin_survives_pressure_until_its_ttl(deployment, model):
    from aaflow.cluster.pins import prompt_prefix

    doc = "A pinned context, read by many workflows of many clients. " * 6
    ids = prompt_prefix(model, doc)
    ttl_s = 8.0
    start = time.monotonic()
    pins = af.pin(deployment, doc, ttl_s=ttl_s)
    assert [p.replica.name for p in pins] == [r.name for r in deployment.replicas()]
    assert all(row["kv_bytes_pinned"] >= pins[0].nbytes for row in af.status(deployment))
    replica = deployment.replicas()[0]
    _pressure(deployment, model, replica)
    assert time.monotonic() - start < ttl_s, "the pressure took longer than the TTL; raise ttl_s"
    assert _computed_again(deployment, model, ids, replica) <= 16, "pinned KV was evicted before its TTL"
    time.sleep(max(0.0, ttl_s - (time.monotonic() - start)) + 0.5)
    _pressure(deployment, model, replica)
    assert _computed_again(deployment, model, ids, replica) == len(ids), "expired pin still held its KV"
    assert af.status(deployment)[0]["kv_bytes_pinned"] == 0


def test_replica_metrics_reach_prometheus(head, deployment, model):
    a, b = deployment.replicas()
    kv = af.materialize(deployment, model, list(range(40, 240)), replica=a)
    moved = af.transfer(kv, b)
    af.free(kv)
    af.free(moved)
    af.status(deployment)  # refreshes every gauge
    wanted = ["ray_aaflow_kv_bytes_held", "ray_aaflow_kv_bytes_pinned", "ray_aaflow_kv_bytes_evictable",
              "ray_aaflow_queue_depth", "ray_aaflow_kv_bytes_moved_total", "ray_aaflow_prefill_tokens_computed_total",
              "ray_aaflow_prefill_tokens_reused_total", "ray_aaflow_busy_seconds_total"]
    names = {a.name, b.name}
    values: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(head.metrics, timeout=10).read().decode()
        values = {}
        for line in text.splitlines():
            name, _, rest = line.partition("{")
            replica = re.search(r'replica="([^"]*)"', rest)
            if name in wanted and replica and replica.group(1) in names:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if set(values) == set(wanted) and values["ray_aaflow_kv_bytes_moved_total"] >= moved.nbytes:
            break
        time.sleep(1)
    assert set(values) == set(wanted), f"missing from {head.metrics}: {sorted(set(wanted) - set(values))}"
    assert values["ray_aaflow_kv_bytes_moved_total"] >= moved.nbytes
    for name in ("busy_seconds_total", "prefill_tokens_computed_total", "prefill_tokens_reused_total"):
        assert values[f"ray_aaflow_{name}"] > 0, values


def test_down_removes_the_deployment(head, deployment):
    from ray.util.state import list_actors

    names = [r.name for r in deployment.replicas()]
    out = cli(head, "down", "--address", head.address)
    assert all(n in out.stdout for n in names)
    alive = [a.name for a in list_actors(address=head.dashboard, filters=[("state", "=", "ALIVE")])
             if a.ray_namespace == "aaflow"]
    assert alive == [], alive
    with pytest.raises(af.DeploymentError):
        af.connect(head.address)
