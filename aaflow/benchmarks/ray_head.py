"""A `ray start --head` on loopback for tests and benchmarks, with its own ports and temp dir, stopped by killing
exactly the processes it started (its process group): never `ray stop`, which stops every Ray
of this user on the machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aaflow.cluster.ray_auth import with_token_auth

REPO = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 now."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def client_env(**extra: str) -> dict[str, str]:
    """The environment for Ray, the CLI and client processes: this checkout first on PYTHONPATH,
    this interpreter's bin first on PATH (its `ray`, `aaflow`), loopback. Token authentication as
    this process has it (a process's auth mode cannot be changed once Ray ran in it): Ray turns it
    on where ~/.ray/auth_token exists, for the head and for drivers, but `ray job submit` sends the
    token only with RAY_AUTH_MODE=token (as the README says), so that is set where a token exists."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    with_token_auth(env)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_metrics_report_interval_ms="1000", HF_HUB_OFFLINE="1",
               RAY_USAGE_STATS_ENABLED="0", **extra)
    env.pop("RAY_ADDRESS", None)
    return env


@dataclass
class RayHead:
    address: str  # host:port of the GCS
    dashboard: str  # http://host:port (Ray Jobs API)
    metrics: str  # http://host:port/metrics (Prometheus)
    env: dict
    group: int  # process group of every process it started

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.group, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.group, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.2)


def start_head(temp_dir: Path, num_cpus: int = 2, timeout_s: float = 120.0, env: dict | None = None) -> RayHead:
    """Start a head node with the dashboard (Ray Jobs) and the metrics export on loopback ports,
    in `env` (default `client_env()`); raises RuntimeError with its output when it does not start."""
    gcs, dash, metrics, agent, agent_grpc, client, runtime_env = free_ports(7)
    env = client_env() if env is None else env
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--metrics-export-port={metrics}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--ray-client-server-port={client}", f"--runtime-env-agent-port={runtime_env}",
           f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"ray start --head did not finish within {timeout_s:.0f} s")
    head = RayHead(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", f"http://127.0.0.1:{metrics}/metrics", env, proc.pid)
    if proc.returncode != 0:
        head.stop()
        raise RuntimeError(f"ray start --head failed ({proc.returncode}):\n{out[-3000:]}")
    return head
