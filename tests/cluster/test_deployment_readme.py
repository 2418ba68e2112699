"""The README's deploy example as written (docs/deployment.md's, Ray Jobs included): each of the
README's commands is a documented one, and the documented commands, with `aaflow serve` and its
`openai` client before `aaflow down`, run as one shell script on a fresh `ray start --head`
(loopback), on a machine with a Ray auth token and on one without. The deployment's behaviour
(clients, leases, pins, metrics): test_deployment.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aaflow.benchmarks.ray_head import REPO
from tests.cluster.deployment_helpers import doc_blocks_tokens, workflow_yaml


def metrics_line(output: str) -> dict:
    found = re.findall(r"^metrics: (\{.*\})$", output, re.M)
    assert found, f"no metrics line in:\n{output}"
    return json.loads(found[-1])


def bash_block(path: Path, heading: str) -> list[str]:
    """The lines of the first bash block after `heading` in `path`."""
    text = path.read_text()
    section = text[text.index(heading):]
    block = section[section.index("```bash") + len("```bash"):]
    return [line.strip() for line in block[:block.index("```")].splitlines() if line.strip()]


def readme_deploy_commands() -> list[str]:
    """docs/deployment.md's deploy example, which the README's shortens."""
    return bash_block(REPO / "docs" / "deployment.md", "## Deploy")


def test_the_readme_deploy_commands_are_the_documented_ones():
    """Each command of the README's deployment example is one of docs/deployment.md's (run below), up
    to the flags the README leaves out."""
    documented = readme_deploy_commands()
    for command in bash_block(REPO / "README.md", "**A long-lived deployment**"):
        assert any(d.startswith(command.split(" --")[0]) and all(f in d for f in command.split()) for d in documented), command


def readme_serve_blocks() -> tuple[str, str]:
    """docs/deployment.md's serve command and its Python client, as written."""
    text = (REPO / "docs" / "deployment.md").read_text()
    section = text[text.index("### Serve over HTTP"):]
    bash = section[section.index("```bash") + len("```bash"):]
    python = section[section.index("```python") + len("```python"):]
    return bash[:bash.index("```")].strip(), python[:python.index("```")].strip()


def newcomer_env(home) -> dict:
    """A newcomer's shell: HOME at `home`, no Ray auth settings of this test process, this checkout's CLI."""
    from aaflow.benchmarks.ray_head import client_env

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

    from aaflow.benchmarks.ray_head import start_head

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
    from aaflow.benchmarks.http_load import wait_until_serving
    from aaflow.benchmarks.ray_head import free_ports

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
        command = command.replace('"$PWD/configs/workflows/review.yaml"', wf).replace("aaflow/configs/workflows/review.yaml", wf)
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
