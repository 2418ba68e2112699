"""N `vllm serve` instances behind one `vllm-router`: what a user past one replica runs instead of aaflow.

Each instance is `.venv-vllm`'s `vllm serve` on loopback, its OpenMP threads bound to its own cores
(`VLLM_CPU_OMP_THREADS_BIND`, no reserved core), prefix caching on, one `VllmConfig` (mode, KV block
size), `--kv-cache-memory-bytes` each, seed 0, max_model_len 8192, served as "smollm2", with
`VLLM_SERVER_DEV_MODE=1` so that `/reset_prefix_cache` clears its cache before each load. The
router (`vllm-router`, installed into `.venv-vllm` by `setup_vllm_env.sh`) spreads OpenAI requests
over them by `policy` (`cache_aware`, `consistent_hash`, `power_of_two`, `round_robin`, ...); it is
restarted to change policy, the instances stay loaded. `counters()` sums vLLM's own Prometheus
counters over the instances (preemptions, prefix-cache queries and hits).

Every process runs in a session of its own, killed whole on `close()` (vLLM's engine-core and
worker processes would otherwise keep spinning on the cores); their output goes to files in a
temporary folder (`log_dir`), whose tails are in every `VllmError`.

With `hosts` ((network namespace, address) per instance: `aaflow.cluster.netns` testbed hosts),
instance i runs inside namespace i and listens on its address; the router runs where the caller
does (inside host 0 for `aaflow bench serve --hosts netns`) and reaches each instance over the link.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from aaflow.benchmarks.common import log
from aaflow.benchmarks.ray_head import free_ports
from aaflow.benchmarks.vllm_config import VllmConfig
from aaflow.benchmarks.vllm_subprocess import VLLM_PYTHON, VllmError
from aaflow.cluster.netns_layout import netns_argv

# `vllm serve`'s server: the `vllm` script itself asks for the distribution "vllm", and vllm-cpu's is "vllm-cpu"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ROUTER_POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin")
SERVED_NAME = "smollm2"
ROUTER_PORT_TRIES = 3
COUNTERS = {"preemptions": "vllm:num_preemptions_total", "prefix_cache_queries": "vllm:prefix_cache_queries_total",
            "prefix_cache_hits": "vllm:prefix_cache_hits_total"}


class VllmFleet:
    """`replicas` `vllm serve` instances of `model_path` in `config`, instance i on `cores[i]` (a list
    of core ids), each with `kv_bytes` of KV, behind a `vllm-router` (`url`: its OpenAI base URL)."""

    def __init__(self, model_path: str, config: VllmConfig, cores: list[list[int]], kv_bytes: int,
                 dtype: str, policy: str = "cache_aware", start_timeout_s: float = 600.0,
                 hosts: list[tuple[str, str]] | None = None) -> None:
        router = VLLM_PYTHON.parent / "vllm-router"
        if not router.exists():
            raise VllmError(f"{router} not found: run `bash scripts/setup_vllm_env.sh` (it installs vllm-router)")
        self.config, self.timeout_s = config, start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="aaflow-vllm-fleet-"))  # each process's output, for errors
        self.router: subprocess.Popen | None = None
        self.ports = free_ports(len(cores) + 2)  # the instances', the router's, the router's metrics
        if hosts is not None and len(hosts) != len(cores):
            raise ValueError(f"{len(hosts)} hosts for {len(cores)} instances: one host each")
        places = hosts or [(None, "127.0.0.1")] * len(cores)
        self.workers = [f"http://{address}:{p}" for (_, address), p in zip(places, self.ports)]
        try:
            for worker_cores, port, (netns, address) in zip(cores, self.ports, places):
                argv = [str(VLLM_PYTHON), "-m", SERVER_MODULE, "--model", model_path,
                        "--served-model-name", SERVED_NAME, "--host", address, "--port", str(port), "--dtype", dtype, "--block-size",
                        str(config.block_size), "--enable-prefix-caching", "--max-model-len", "8192", "--seed", "0",
                        "--kv-cache-memory-bytes", str(int(kv_bytes)), "--scheduling-policy", config.scheduling,
                        "--disable-uvicorn-access-log", "--enable-prompt-tokens-details",
                        *(["--enforce-eager"] if config.mode == "eager" else [])]
                self.procs.append(self._spawn(
                    netns_argv(netns, argv) if netns else argv,
                    {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, worker_cores)),
                     "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_SERVER_DEV_MODE": "1"}))
            for worker, proc in zip(self.workers, self.procs):
                self._wait_healthy(worker, proc)
            self.set_policy(policy)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """The router's OpenAI base URL."""
        return f"http://127.0.0.1:{self.ports[-2]}/v1"

    def set_policy(self, policy: str) -> None:
        """(Re)start the router with `policy`; the instances stay loaded."""
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy {policy!r}: use one of {', '.join(ROUTER_POLICIES)}")
        self._stop(self.router)
        self.policy = policy
        for attempt in range(ROUTER_PORT_TRIES):
            self.router = self._spawn([str(VLLM_PYTHON.parent / "vllm-router"), "--host", "127.0.0.1", "--port",
                                       str(self.ports[-2]), "--policy", policy, "--worker-urls", *self.workers,
                                       "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.ports[-1]),
                                       "--log-level", "warning"], {})
            try:
                self._wait_healthy(self.url.removesuffix("/v1"), self.router, path="/v1/models")
                return
            except VllmError as exc:  # a port free when chosen can be taken since (the instances' own sockets)
                if "Address already in use" not in str(exc) or attempt == ROUTER_PORT_TRIES - 1:
                    raise
                log(f"vllm-router: port {self.ports[-2]} or {self.ports[-1]} was taken since; trying two others")
                self.ports[-2:] = free_ports(2)

    def reset_prefix_caches(self) -> None:
        """Clear every instance's prefix cache (before a load, as aaflow's are cleared)."""
        for worker in self.workers:
            urllib.request.urlopen(urllib.request.Request(f"{worker}/reset_prefix_cache", method="POST"),
                                   timeout=60).read()

    def counters(self) -> dict[str, float]:
        """vLLM's own counters summed over the instances (read before and after a load)."""
        totals = dict.fromkeys(COUNTERS, 0.0)
        for worker in self.workers:
            text = urllib.request.urlopen(f"{worker}/metrics", timeout=60).read().decode()
            for line in text.splitlines():
                for key, metric in COUNTERS.items():
                    if line.startswith(metric):
                        totals[key] += float(line.rsplit(" ", 1)[1])
        return totals

    def close(self) -> None:
        for proc in [self.router, *self.procs]:
            self._stop(proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        environ = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # would override the bytes
        log_path = self.log_dir / f"{Path(argv[0]).name}-{len(self.procs)}-{int(time.time())}.log"
        with open(log_path, "w") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, env={**environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        proc.log_path = log_path
        return proc

    def _wait_healthy(self, base: str, proc: subprocess.Popen, path: str = "/health") -> None:
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:
            if proc.poll() is not None:
                raise VllmError(f"{base} exited {proc.returncode}: {_tail(proc)}")
            try:
                urllib.request.urlopen(base + path, timeout=5).read()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        raise VllmError(f"{base} did not answer {path} within {self.timeout_s:.0f} s: {_tail(proc)}")

    @staticmethod
    def _stop(proc: subprocess.Popen | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def _tail(proc: subprocess.Popen, lines: int = 20) -> str:
    try:
        return "\n".join(Path(proc.log_path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def split_cores(replicas: int, cores: int | None = None) -> list[list[int]]:
    """Core ids per replica: the machine's cores in `replicas` equal contiguous groups (one each on
    2 cores and 2 replicas), as aaflow splits them among its replicas."""
    total = cores or os.cpu_count() or 1
    if replicas > total:
        raise ValueError(f"{replicas} replicas on {total} cores: at least one core each")
    per = total // replicas
    log(f"vLLM fleet: {replicas} instances of {per} core(s) each")
    return [list(range(i * per, (i + 1) * per)) for i in range(replicas)]
