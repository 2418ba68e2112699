"""The achieved throughput of a testbed link (`aaflow.cluster.netns`): one bulk TCP stream between two
hosts' addresses, a sink in one namespace and a source in the other."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from aaflow.cluster.netns_layout import Layout, NetnsError, checked, netns_argv

_SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
left, buf = int(sys.argv[2]), bytearray(1 << 20)
while left > 0:
    n = conn.recv_into(buf, min(len(buf), left))
    if not n:
        break
    left -= n
conn.sendall(b"k")
"""

_SOURCE = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
left, chunk = int(sys.argv[3]), memoryview(bytearray(4 << 20))
t0 = time.perf_counter()
while left > 0:
    conn.sendall(chunk[:min(len(chunk), left)])
    left -= min(len(chunk), left)
conn.recv(1)
print(time.perf_counter() - t0)
"""


def measure_link(layout: Layout, src: int, dst: int, nbytes: int = 64 << 20, timeout_s: float = 120.0) -> float:
    """Bytes/s of one bulk TCP stream from host `src` to host `dst` over the testbed's link (a sink
    listening on `dst`'s address, a source sending `nbytes` and waiting for its acknowledgement)."""
    py = sys.executable
    sink = subprocess.Popen(netns_argv(layout.hosts[dst].netns, [py, "-c", _SINK, layout.hosts[dst].address,
                                                                   str(nbytes)]),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = sink.stdout.readline().strip()
        if not port.isdigit():
            raise NetnsError(f"the link sink in {layout.hosts[dst].netns} did not start")
        out = checked(*netns_argv(layout.hosts[src].netns, [py, "-c", _SOURCE, layout.hosts[dst].address, port,
                                                         str(nbytes)]), timeout=timeout_s)
        return nbytes / float(out.strip())
    finally:
        if sink.poll() is None:
            os.killpg(sink.pid, signal.SIGKILL)
        sink.wait()
