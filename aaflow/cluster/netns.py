"""Several "hosts" on one machine: Linux network namespaces joined by rate-limited veth links.

`NetnsTestbed(hosts=2, rate_mbit=1000)` makes namespaces `aafns-<pid>-<i>` (one per host) and a
hub namespace `aafns-<pid>-hub` holding a bridge. Each host has one veth interface, `aafnsv`, with
address `10.231.0.<i+1>/24`, whose peer sits on the hub's bridge. A `tc` token bucket (`tbf`) on
both ends of every link caps each host's egress and ingress at the rate, so host-to-host traffic
crosses a real TCP/IP link of that bandwidth. Nothing is created in the machine's own namespace, the
namespaces have no route anywhere else, and deleting them removes their links and qdiscs.

With `ray=True` it runs a Ray node in each namespace (`ray start --head` in host 0, `ray start
--address` in the others, each with its own temp dir and `--node-ip-address` its namespace address;
its servers listen on every interface of a namespace that has only loopback and that address), and
code that should reach the cluster runs inside a host with `testbed.popen(0, argv)` / `testbed.run(...)`
(`ip netns exec`). `close()` (or leaving the `with` block, or exit) kills the process groups it
started and deletes the namespaces, even after an error. `aaflow.cluster.netns_layout.available()` says whether this machine
can do any of this, and why not; `aaflow.cluster.netns_link.measure_link` a link's achieved throughput.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from aaflow.cluster.netns_layout import (DEVICE, PREFIX, RAY_PORT, SUBNET, Host, Layout, NetnsError, checked, link_up,
                                  netns_argv, set_rate)
from aaflow.cluster.ray_auth import with_token_auth

REPO = Path(__file__).resolve().parents[2]
_SERIAL = itertools.count()  # testbeds made by this process: their names never clash


class NetnsTestbed:
    """Namespaced hosts on rate-limited links, optionally each running a Ray node (see the module doc).

    Args:
        hosts: how many host namespaces (2 or 3 make sense on a 2-core machine).
        rate_mbit: the link rate (Mbit/s) each way; None leaves the veth links unlimited.
        ray: start a Ray node in every host (`node_cpus` CPUs each, `object_store_bytes` of store).
        env: extra environment for the Ray nodes and for processes started with `popen` / `run`.
    """

    def __init__(self, hosts: int = 2, rate_mbit: float | None = None, ray: bool = True, node_cpus: int = 1,
                 object_store_bytes: int = 1 << 30, env: dict[str, str] | None = None,
                 ray_timeout_s: float = 120.0) -> None:
        if not 2 <= hosts <= 8:
            raise ValueError(f"hosts must be 2..8, got {hosts}")
        self._tag = f"{PREFIX}-{os.getpid()}-{next(_SERIAL)}"
        self.layout = Layout(tuple(Host(i, f"{self._tag}-{i}", f"{SUBNET}.{i + 1}") for i in range(hosts)),
                             f"{self._tag}-hub", None)
        self._rate, self._ray, self._cpus, self._store = rate_mbit, ray, node_cpus, object_store_bytes
        self._extra_env, self._ray_timeout_s = dict(env or {}), ray_timeout_s
        self._groups: list[int] = []  # process groups started here
        self._temp: Path | None = None
        self._made: list[str] = []
        self._closed = False

    @property
    def temp_dir(self) -> Path | None:
        """The Ray nodes' temp dirs live below it (None before `start`); `close()` removes it."""
        return self._temp

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "NetnsTestbed":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "NetnsTestbed":
        """Make the namespaces, links, addresses and qdiscs, then the Ray nodes. Cleans up and raises
        `NetnsError` where a step fails."""
        atexit.register(self.close)
        self._on_sigterm()
        self._temp = Path(tempfile.mkdtemp(prefix=f"{self._tag}-", dir="/tmp"))  # Ray's, short: socket paths
        try:
            self._make_network()
            set_rate(self.layout, self._rate)
            if self._ray:
                self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def _on_sigterm(self) -> None:
        """In the main thread, where SIGTERM would end the process without running `atexit`: make
        it raise SystemExit instead, so that `close()` still runs (restored by `close()`)."""
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def _exit(signum, frame):
                raise SystemExit(128 + signum)

            self._old_sigterm = signal.signal(signal.SIGTERM, _exit)

    def _make_network(self) -> None:
        hub = self.layout.hub
        checked("ip", "netns", "add", hub)
        self._made.append(hub)
        checked("ip", "-n", hub, "link", "add", f"{PREFIX}br", "type", "bridge")
        link_up(hub, f"{PREFIX}br")
        for h in self.layout.hosts:
            checked("ip", "netns", "add", h.netns)
            self._made.append(h.netns)
            port = f"{PREFIX}p{h.index}"
            checked("ip", "link", "add", "name", h.device, "netns", h.netns, "type", "veth", "peer", "name", port,
                    "netns", hub)
            checked("ip", "-n", hub, "link", "set", port, "master", f"{PREFIX}br")
            link_up(hub, port)
            checked("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.device)
            link_up(h.netns, h.device)
            checked("ip", "-n", h.netns, "link", "set", "lo", "up")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of processes inside the testbed: this checkout on PYTHONPATH, this
        interpreter's `bin` on PATH, UCX over TCP on the link's interface, no usage stats."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        with_token_auth(env)  # the head turns token auth on where a token exists: so must the rest
        env.update(UCX_NET_DEVICES=DEVICE, UCX_TLS="tcp", GLOO_SOCKET_IFNAME=DEVICE, RAY_USAGE_STATS_ENABLED="0",
                   HF_HUB_OFFLINE="1", AAFLOW_NETNS_LAYOUT=self.layout.to_json(), **self._extra_env, **extra)
        return env

    def _start_ray(self) -> None:
        head = self.layout.hosts[0]
        address = f"{head.address}:{RAY_PORT}"
        self.layout = Layout(self.layout.hosts, self.layout.hub, address)
        ray_bin = str(Path(sys.executable).parent / "ray")
        for h in self.layout.hosts:
            role = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if h.index == 0 else [
                f"--address={address}"]
            argv = [ray_bin, "start", *role, f"--node-ip-address={h.address}", f"--num-cpus={self._cpus}",
                    f"--object-store-memory={self._store}", f"--temp-dir={self._temp / str(h.index)}",
                    f"--resources={json.dumps({f'{PREFIX}_host_{h.index}': 1})}", "--disable-usage-stats"]
            proc = self.popen(h.index, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                out, _ = proc.communicate(timeout=self._ray_timeout_s)
            except subprocess.TimeoutExpired:
                raise NetnsError(f"`ray start` in {h.netns} did not finish within {self._ray_timeout_s:.0f} s")
            if proc.returncode != 0:
                raise NetnsError(f"`ray start` in {h.netns} failed ({proc.returncode}):\n{out[-2000:]}")

    def close(self) -> None:
        """Kill every process group started here, then delete the namespaces (their links and
        qdiscs go with them) and the temp dir. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            alive = [g for g in self._groups if _group_alive(g)]
            for g in alive:
                try:
                    os.killpg(g, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while alive and time.monotonic() < deadline:
                alive = [g for g in alive if _group_alive(g)]
                time.sleep(0.2)
        for pid in self._netns_pids():  # Ray daemons that left their group (they start their own sessions)
            _kill(pid)
        for netns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self._made = []
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
        atexit.unregister(self.close)
        if getattr(self, "_old_sigterm", None) is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)

    def _netns_pids(self) -> list[int]:
        pids: set[int] = set()
        for netns in self._made:
            out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
            pids.update(int(p) for p in out.stdout.split() if p.isdigit())
        return sorted(pids)

    # ----------------------------------------------------------------- running things inside
    def popen(self, host: int, argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start `argv` inside host `host`'s namespace, in a new process group that `close()` kills."""
        kwargs.setdefault("text", True)
        proc = subprocess.Popen(netns_argv(self.layout.hosts[host].netns, argv), env=env or self.env(),
                                start_new_session=True, cwd=str(REPO), **kwargs)
        self._groups.append(proc.pid)
        return proc

    def run(self, host: int, argv: list[str], timeout_s: float = 600.0, **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside host `host` to completion (stdout and stderr captured)."""
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise NetnsError(f"{argv[:3]} in host {host} ran past {timeout_s:.0f} s:\n{err[-2000:]}")
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
