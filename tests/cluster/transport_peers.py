"""Transport endpoints for the KV transport tests (test_transports.py, test_transport_registry.py):
the backends, KV shapes, deterministic KV content rebuilt on the destination to check a copy,
`Peer` (one endpoint and the tensors it keeps alive, in-process or as a Ray actor) and `RemotePeer`
(a `Peer` actor's methods, called synchronously)."""

from __future__ import annotations

import time

import torch

from aaflow.cluster.transports import Transport, get_transport
from aaflow.cluster.transports.base import as_bytes

BACKENDS = ["local", "ray", "nixl", "ucx"]

# [layers, 2, tokens, kv_heads, head_dim]
TINY = (2, 2, 3, 3, 7)  # 252 elements: 504 / 1,008 bytes, well under a page
SMOLLM2_77 = (30, 2, 77, 3, 64)  # 1,774,080 bytes in bf16: not a multiple of 4 KiB
SMOLLM2_512 = (30, 2, 512, 3, 64)  # 11.25 MiB in bf16, 22.5 MiB in fp32
FAST_S = 5.0  # a failing fetch must raise well within this


def make_kv(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """Deterministic KV-like content, rebuilt on the destination to check the copy."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(getattr(torch, dtype))


class Peer:
    """One transport endpoint and the tensors it keeps alive; a Ray actor, or in-process."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: Transport = get_transport(name)
        self.exposed: dict[str, torch.Tensor] = {}
        self.outs: dict[tuple, torch.Tensor] = {}
        self.pool: torch.Tensor | None = None

    def expose(self, shape, dtype, seed=0):
        tensor = make_kv(shape, dtype, seed)
        handle = self.transport.expose(tensor)
        self.exposed[handle.handle_id] = tensor
        return handle

    def expose_from_pool(self, shape, dtype, seed, offset_elems):
        """Expose a slice of a pool registered once (an unaligned offset on purpose)."""
        if self.pool is None:
            self.pool = torch.zeros(4 * 2**20, dtype=torch.bfloat16)
            self.transport.register_pool(self.pool)
        kv = make_kv(shape, "bfloat16", seed)
        view = self.pool[offset_elems : offset_elems + kv.numel()].view(shape)
        view.copy_(kv)
        return self.transport.expose(view)

    def drop_pool(self):
        self.transport.unregister_pool(self.pool)
        self.pool = None

    def release(self, handle):
        self.transport.release(handle)
        self.exposed.pop(handle.handle_id, None)

    def fetch(self, handle, seed=0, timeout_s=30.0, shape=None, dtype=None):
        """Fetch into a reused, scribbled-over `out`; report exactness and registrations."""
        shape, dtype = shape or handle.shape, dtype or handle.dtype
        out = self.outs.setdefault((shape, dtype), torch.empty(shape, dtype=getattr(torch, dtype)))
        as_bytes(out).fill_(0xA5)
        stats = self.transport.fetch(handle, out, timeout_s=timeout_s)
        expected = make_kv(shape, dtype, seed)
        return dict(
            equal=torch.equal(out, expected),
            bytes_equal=torch.equal(as_bytes(out), as_bytes(expected)),
            nbytes=stats.nbytes,
            seconds=stats.seconds,
            registrations=self.transport.num_registrations,
        )

    def fetch_error(self, handle, out_nbytes=None, timeout_s=FAST_S):
        """Fetch expecting failure: (exception type, message, seconds)."""
        nbytes = handle.nbytes if out_nbytes is None else out_nbytes
        out = torch.empty(nbytes, dtype=torch.uint8)
        start = time.monotonic()
        try:
            self.transport.fetch(handle, out, timeout_s=timeout_s)
        except Exception as err:
            return type(err).__name__, str(err), time.monotonic() - start
        return None, "fetch succeeded", time.monotonic() - start

    def registrations(self):
        return self.transport.num_registrations

    def reopen(self):
        self.transport.close()
        self.transport = get_transport(self.name)
        self.exposed.clear()
        self.outs.clear()
        self.pool = None

    def close(self):
        self.transport.close()


class RemotePeer:
    """Calls a `Peer` actor's methods synchronously (tests read like in-process calls)."""

    def __init__(self, actor) -> None:
        self._actor = actor

    def start(self, method, *args):
        """Call without waiting: the ObjectRef of the result."""
        return getattr(self._actor, method).remote(*args)

    def __getattr__(self, method):
        import ray

        return lambda *args, **kwargs: ray.get(
            getattr(self._actor, method).remote(*args, **kwargs), timeout=120
        )
