"""The namespaces of a `aaflow.cluster.netns.NetnsTestbed`: their names and addresses (`Host`, `Layout`), the
commands that make them (`checked`, `netns_argv`, `set_rate`), whether this machine can (`available`)
and what is left of them (`leftovers`). Nothing here touches the machine's own namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

from aaflow.common.errors import AAFlowError

PREFIX = "aafns"
DEVICE = "aafnsv"  # the host side of each link, the same name inside every host namespace
SUBNET = "10.231.0"  # /24, exists only inside the testbed's namespaces
RAY_PORT = 6379  # each namespace has its own ports: no clash with a Ray outside it

class NetnsError(AAFlowError, RuntimeError):
    """A namespace, link, qdisc or Ray node of the testbed could not be made; the message says which."""


def checked(*argv: str, timeout: float = 30.0) -> str:
    """Run `argv`; its stdout, or `NetnsError` with its stderr where it fails."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return out.stdout


def available() -> tuple[bool, str]:
    """(True, "") where namespaces, veth links and tbf qdiscs can be made here, else (False, why)."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        checked("ip", "netns", "add", probe)
        try:
            checked("ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b")
            checked("tc", "-n", probe, "qdisc", "add", "dev", "a", "root", "tbf", "rate", "100mbit", "burst", "64kb",
                    "latency", "50ms")
        finally:
            checked("ip", "netns", "del", probe)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot make a namespace with a veth link and a tbf qdisc here: {exc}"
    return True, ""


@dataclass(frozen=True)
class Host:
    """One namespace of the testbed: its name, its address on the link, its interface."""

    index: int
    netns: str
    address: str
    device: str = DEVICE


@dataclass(frozen=True)
class Layout:
    """What a process inside the testbed needs to know of it (JSON-serialisable)."""

    hosts: tuple[Host, ...]
    hub: str
    ray_address: str | None  # "10.231.0.1:6379" once Ray runs

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Layout":
        data = json.loads(text)
        return cls(tuple(Host(**h) for h in data["hosts"]), data["hub"], data["ray_address"])

    def ports(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every link: where the rate limit sits."""
        return [(h.netns, h.device) for h in self.hosts] + [(self.hub, f"{PREFIX}p{h.index}") for h in self.hosts]


def set_rate(layout: Layout, rate_mbit: float | None) -> None:
    """Cap every link at `rate_mbit` Mbit/s each way (tbf on both ends), or lift the cap with None.
    The bucket holds 2 ms of traffic (at least 64 KiB) so that tbf is accurate at Gbit rates too."""
    for netns, dev in layout.ports():
        subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if rate_mbit is not None:
            burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 2e-3))
            checked("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                    "burst", str(burst), "latency", "50ms")


def netns_argv(netns: str, argv: list[str]) -> list[str]:
    """`argv` run inside namespace `netns`."""
    return ["ip", "netns", "exec", netns, *argv]


def link_up(netns: str, dev: str) -> None:
    """Bring `dev` up without an IPv6 link-local address (none of its neighbour discovery traffic):
    the only addresses on the link are the testbed's own."""
    checked("ip", "-n", netns, "link", "set", "dev", dev, "addrgenmode", "none")
    checked("ip", "-n", netns, "link", "set", "dev", dev, "up")


def leftovers() -> list[str]:
    """Testbed namespaces of this process that still exist (a teardown check)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}-{os.getpid()}-")]
