"""A long-lived deployment on a real `ray start --head` (loopback): the README's Deploy example as
written (Ray Jobs included), two client processes at once sharing the document's KV, pins with a
TTL under eviction pressure, status, Ray metrics read back from Prometheus, and down."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import aaflow as af
from benchmarks.ray_head import REPO, start_head

LEASE_S = 6.0  # the deployment's client lease: a killed client's runs go within seconds

DOC = ("Paged attention stores the KV cache in fixed-size blocks, so that sequences share blocks "
       "copy-on-write and a prefix computed once serves every later request that starts with it. ") * 2
QUESTIONS = {"summary": "Summarize the document in one line.", "questions": "Ask two questions about it."}


def workflow_yaml(folder, name: str, model: str, agents: dict[str, str], doc: str = DOC) -> str:
    (folder / "doc.txt").write_text(doc)
    lines = [f"name: {name}", "contexts:", "  doc: {file: doc.txt}", "agents:"]
    for agent, question in agents.items():
        lines.append(f"  {agent}: {{model: {json.dumps(model)}, prompt: [{{ref: doc}}, {json.dumps(question)}], "
                     "max_tokens: 8, ignore_eos: true}")
    path = folder / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def cli(head, *args, timeout=300, check=True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "aaflow.cli", *args], env=head.env, cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"aaflow {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out


def metrics_line(output: str) -> dict:
    found = re.findall(r"^metrics: (\{.*\})$", output, re.M)
    assert found, f"no metrics line in:\n{output}"
    return json.loads(found[-1])


def doc_blocks_tokens(model: str, doc: str = DOC, block: int = 16) -> int:
    from cluster.pins import prompt_prefix

    return len(prompt_prefix(model, doc)) // block * block


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    import ray

    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    # what Ray itself does before starting a local cluster: token auth on where a token exists
    # (ray start does the same for the head; tests/ray_head.py passes the mode to every client)
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


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return str(tiny_llama_dir)


def test_connect_without_a_deployment_names_the_fix(head):
    with pytest.raises(af.DeploymentError, match="aaflow up --address"):
        af.connect(head.address)
    out = cli(head, "status", "--address", head.address, check=False)
    assert out.returncode == 2 and "no aaflow deployment" in out.stderr
    from benchmarks.ray_head import free_ports

    with pytest.raises(af.DeploymentError, match="nothing answers at"):
        af.connect(f"127.0.0.1:{free_ports(1)[0]}")
    with pytest.raises(af.DeploymentError, match="no Ray address"):
        af.connect()  # and no RAY_ADDRESS


def readme_deploy_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Deploy"):]
    block = section[section.index("```bash") + len("```bash"):]
    return [line.strip() for line in block[:block.index("```")].splitlines() if line.strip()]


def readme_serve_blocks() -> tuple[str, str]:
    """The README's serve command and its Python client, as written."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Serve over HTTP"):]
    bash = section[section.index("```bash") + len("```bash"):]
    python = section[section.index("```python") + len("```python"):]
    return bash[:bash.index("```")].strip(), python[:python.index("```")].strip()


def newcomer_env(home) -> dict:
    """A newcomer's shell: HOME at `home`, no Ray auth settings of this test process, this checkout's CLI."""
    from benchmarks.ray_head import client_env

    env = client_env(HOME=str(home))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize("token", [True, False], ids=["with-ray-auth-token", "without-ray-auth-token"])
def test_readme_deploy_example_runs_as_written_with_ray_jobs(model, tmp_path, token):
    """The README's deploy commands as one shell script, with this head's ports, the tiny model and
    a workflow over it, and before `aaflow down` its serve command and `openai` client, on a machine
    where ~/.ray/auth_token exists (Ray then turns token authentication on) and where it does not."""
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    from benchmarks.ray_head import start_head

    commands = readme_deploy_commands()
    assert commands[0].startswith("ray start --head") and any(c.startswith("ray job submit") for c in commands)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    if token:
        (home / ".ray" / "auth_token").write_text(generate_new_authentication_token())
    env = newcomer_env(home)
    ray_dir = Path(tempfile.mkdtemp(prefix="aaflow-ray-"))  # short: Ray's socket paths must stay under 108 bytes
    try:
        try:
            head = start_head(ray_dir, env=dict(env))
        except RuntimeError as exc:
            pytest.skip(f"cannot start a Ray head with its dashboard (Ray Jobs) here: {exc}")
        try:
            outputs = _run_readme_commands(commands[1:-1], head, env, model, tmp_path)
            _run_readme_serve_example(head, env, model)
            outputs += _run_readme_commands(commands[-1:], head, env, model, tmp_path)
        finally:
            head.stop()
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    first = next(text for command, text in outputs if "aaflow.cli submit" in command)
    job = next(text for command, text in outputs if command.startswith("ray job submit"))
    for name in ("r1", "r2", "meta"):
        assert f"--- {name} ---" in first and f"--- {name} ---" in job, job
    assert "succeeded" in job
    # the job's submission reuses the document KV the first submission left in the prefix cache
    assert metrics_line(job)["prefill_reused"] >= 2 * doc_blocks_tokens(model), job
    status = next(text for command, text in outputs if "aaflow.cli status" in command)
    assert "queue" in status and "pinned" in status and model[-16:] in status
    assert "no aaflow deployment" in outputs[-1][1], outputs[-1]  # `aaflow down` removed it


def _run_readme_serve_example(head, env: dict, model: str) -> None:
    """`aaflow serve` on the deployment, then the README's `openai` client (this head's port, the
    tiny model, a free HTTP port)."""
    from benchmarks.http_load import wait_until_serving
    from benchmarks.ray_head import free_ports

    command, client = readme_serve_blocks()
    assert command.startswith("aaflow serve --address 127.0.0.1:6379")
    port = free_ports(1)[0]
    args = command.replace("127.0.0.1:6379", head.address).replace("--port 8000", f"--port {port}").split()[1:]
    server = subprocess.Popen([sys.executable, "-m", "aaflow.cli", *args], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(server, port)
        script = client.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace('"smollm2"', json.dumps(model))
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip()  # the answer and its cached tokens
    finally:
        server.terminate()
        server.wait(timeout=30)


def _run_readme_commands(commands: list[str], head, env: dict, model: str, tmp_path) -> list[tuple[str, str]]:
    """`commands` (the head's start left out: `head` is ours, started with the same flags and free
    ports) in one bash, in order, then `aaflow status` once more: (command, its output) in order."""
    first = readme_deploy_commands()[0]
    wf = workflow_yaml(tmp_path, "review", model, {"r1": "Review the method.", "r2": "Review the novelty.",
                                                   "meta": "Give a verdict."})
    ports = re.search(r"--port=(\d+).*--dashboard-port=(\d+).*--metrics-export-port=(\d+)", first).groups()
    ours = (head.address.rsplit(":", 1)[1], head.dashboard.rsplit(":", 1)[1], head.metrics.split(":")[2].split("/")[0])
    script, shown = ["set -e"], []
    for command in [*commands, "aaflow status --address 127.0.0.1:6379"]:
        for theirs, mine in zip(ports, ours):
            command = command.replace(f":{theirs}", f":{mine}")
        command = command.replace('"$PWD/configs/workflows/review.yaml"', wf).replace("configs/workflows/review.yaml", wf)
        command = command.replace("smollm2=2", f"{model}=2")
        if command.startswith("aaflow "):  # this checkout's CLI, whatever `aaflow` is installed
            command = f"{sys.executable} -m aaflow.cli {command[len('aaflow '):]}"
        shown.append(command)
        script += [f"echo '@@@ {len(shown) - 1}'", f"{command} 2>&1" + (" || true" if len(shown) > len(commands) else "")]
    out = subprocess.run(["bash", "-c", "\n".join(script)], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    pieces = re.split(r"^@@@ (\d+)$", out.stdout, flags=re.M)
    outputs = [(shown[int(i)], text) for i, text in zip(pieces[1::2], pieces[2::2])]
    assert out.returncode == 0, f"{shown[len(outputs) - 1]} failed ({out.returncode}):\n{out.stdout[-4000:]}"
    return outputs


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
    from cluster.pins import prompt_prefix

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
