"""A replica as both ends of a KV transfer: expose a ref to a peer, receive a peer's ref.

Two paths, chosen by the transport:
- in place (`Transport.supports_segments`, i.e. `nixl`): the source exposes the ref's KV where it
  lies in its pool (a fork holds the blocks until `release`); the destination reserves blocks and
  the transport reads straight into them. No staging copy on either side; the pool is registered
  with the transport once.
- staged (every other transport): the KV is gathered into a registered, reused send buffer; the
  destination fetches into a reused receive buffer and imports it into its pool.

Both check the model fingerprint, shape and dtype before any byte lands, and a failed fetch leaves
the destination pool as it was (reserved blocks are freed; a READ that could not be cancelled
keeps its blocks out of use instead).
"""

from __future__ import annotations

import logging

import torch

from aaflow.cluster.receive_checks import KVShape, ReceiverGeometry, as_transfer_error, check_incoming
from aaflow.cluster.transports import get_transport
from aaflow.cluster.transports.base import TransferStillRunningError
from aaflow.operators import KVPayload, Lineage
from aaflow.runtime.replies import Exposure, Received

log = logging.getLogger(__name__)


def _round_up(nbytes: int) -> int:
    """Buffer sizes grow in powers of two (at least 1 MiB) so that a few buffers serve every size."""
    return max(2**20, 1 << (nbytes - 1).bit_length())


class TransferEndpoint:
    """A built-in replica's two ends of a transfer, and the transports and buffers they keep."""

    def __init__(self, name: str, engine, host, refs, faults) -> None:
        """`refs`: the replica's `RefTable`; `faults`: its `FaultInjection`."""
        self.name, self.engine, self.host, self.refs, self.faults = name, engine, host, refs, faults
        self._transports: dict[str, object] = {}
        self._pool_registered: set[str] = set()  # transports the engine's KV pool is registered with
        self._recv_buffers: dict[str, torch.Tensor] = {}  # per transport, reused (registered once)
        self._send_free: dict[str, list[torch.Tensor]] = {}  # idle staging buffers per transport
        self._send_busy: dict[str, torch.Tensor] = {}  # handle id -> staging buffer in use
        self._send_held: dict[str, int] = {}  # handle id -> engine sequence holding exposed blocks
        self._quarantined: list[int] = []  # sequences a READ that could not be cancelled may still write

    def _transport(self, name: str):
        if name not in self._transports:
            self._transports[name] = get_transport(name)
        return self._transports[name]

    def _in_place(self, name: str):
        """The transport if it moves KV in place (its pool registered once), else None."""
        transport = self._transport(name)
        if not transport.supports_segments:
            return None
        if name not in self._pool_registered:
            transport.register_pool(self.engine.kv_pool)
            self._pool_registered.add(name)
        return transport

    # --- source side ----------------------------------------------------------------------
    def expose(self, ref_id: str, transport: str) -> Exposure:
        """Make the ref's KV readable by a peer: its handle, the shape a receiver checks, its record.

        In place where the transport allows (the exposed blocks are held by a fork until
        `release`, so the ref may be freed or extended meanwhile); otherwise gathered once into a
        registered staging buffer that is reused after `release`.
        """
        self.faults.reached("expose")
        handle, kv_shape, record = self._expose(ref_id, transport)
        if self.faults.stale_exposure():  # fault injection: the peer will meet a released exposure
            self.release(handle, transport)
        return Exposure(handle, kv_shape, record)

    def _expose(self, ref_id: str, transport: str) -> tuple[object, KVShape, object]:
        ref = self.refs.get(ref_id)
        lay = self.engine.kv_layout
        shape = (lay.num_layers, 2, len(ref), lay.num_kv_heads, lay.head_dim)
        kv_shape = KVShape(ref.fingerprint, shape, str(lay.dtype).removeprefix("torch."))
        in_place = self._in_place(transport)
        if in_place is not None:
            held = self.engine.fork(self.host.sequence(ref))
            try:
                handle = in_place.expose_segments(self.engine.kv_pool, self.engine.kv_segments(held), shape, lay.dtype)
            except Exception:
                self.engine.free(held)
                raise
            self._send_held[handle.handle_id] = held
            return handle, kv_shape, self.refs.add(ref)
        nbytes = torch.Size(shape).numel() * lay.dtype_bytes
        buf = self._staging_buffer(transport, nbytes)
        staged = buf[:nbytes].view(lay.dtype).view(shape)
        try:
            self.engine.export_kv(self.host.sequence(ref), out=staged)
            handle = self._transport(transport).expose(staged)
        except Exception:
            self._send_free[transport].append(buf)
            raise
        self._send_busy[handle.handle_id] = buf
        return handle, kv_shape, self.refs.add(ref)

    def _staging_buffer(self, transport: str, nbytes: int) -> torch.Tensor:
        """An idle send buffer of at least `nbytes`, registered with the transport once."""
        idle = self._send_free.setdefault(transport, [])
        for i, buf in enumerate(idle):
            if buf.numel() >= nbytes:
                return idle.pop(i)
        buf = torch.empty(_round_up(nbytes), dtype=torch.uint8)
        self._transport(transport).register_pool(buf)
        return buf

    def release(self, handle, transport: str) -> None:
        """Stop exposing; held blocks are freed, a staging buffer goes back to the idle list.
        Idempotent."""
        self._transport(transport).release(handle)
        held = self._send_held.pop(handle.handle_id, None)
        if held is not None:
            self.engine.free(held)
        buf = self._send_busy.pop(handle.handle_id, None)
        if buf is not None:
            self._send_free[transport].append(buf)

    # --- destination side -----------------------------------------------------------------
    def receive(self, handle, shape: KVShape, record, transport: str, timeout_s: float = 30.0) -> Received:
        """Pull a peer's exposed KV and import it as a new ref here (its record and `TransferStats`).

        The fingerprint, shape and dtype are checked before any byte is received; a failed fetch
        raises `KVTransferError` and leaves this pool exactly as it was.
        """
        self.faults.maybe_fail("receive")
        lay = self.engine.kv_layout
        check_incoming(handle, shape, record, ReceiverGeometry(self.name, self.engine.fingerprint, lay.num_layers,
                                                               lay.num_kv_heads, lay.head_dim, lay.dtype))
        self.engine.check_room(len(record.token_ids))  # before a receive buffer or pool blocks are taken
        in_place = self._in_place(transport)
        fetch = self._fetch_in_place if in_place is not None else self._fetch_staged
        seq, stats = as_transfer_error(transport, self.name,
                                        lambda: fetch(handle, shape, record, transport, timeout_s))
        lineage = Lineage("transfer", (record.id,), (("from", record.replica), ("transport", transport)))
        return Received(self.refs.add(self.host.register(seq, lineage, record.fidelity)), stats)

    def _fetch_in_place(self, handle, shape: KVShape, record, transport: str, timeout_s: float):
        """Reserve blocks, let the transport write them, seal them: (sequence, stats)."""
        seq = self.engine.reserve_kv(shape.fingerprint, record.token_ids, cacheable=record.exact)
        try:
            stats = self._transport(transport).fetch_segments(
                handle, self.engine.kv_pool, self.engine.kv_segments(seq), timeout_s=timeout_s)
        except TransferStillRunningError:
            log.warning("replica %s: keeping %d tokens of pool out of use under an uncancelled READ",
                        self.name, len(record.token_ids))
            self._quarantined.append(seq)
            raise
        except BaseException:
            self.engine.free(seq)
            raise
        self.engine.seal_kv(seq)
        return seq, stats

    def _fetch_staged(self, handle, shape: KVShape, record, transport: str, timeout_s: float):
        """Fetch into the reused receive buffer, then import into the pool: (sequence, stats)."""
        lay = self.engine.kv_layout
        dims = tuple(shape.shape)
        nbytes = torch.Size(dims).numel() * lay.dtype_bytes
        buf = self._receive_buffer(transport, nbytes)[:nbytes]
        stats = self._transport(transport).fetch(handle, buf, timeout_s=timeout_s)
        payload = KVPayload(shape.fingerprint, record.token_ids, buf.view(lay.dtype).view(dims))
        return self.engine.import_kv(payload, cacheable=record.exact), stats

    def _receive_buffer(self, transport: str, nbytes: int) -> torch.Tensor:
        buf = self._recv_buffers.get(transport)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(_round_up(nbytes), dtype=torch.uint8)
            self._transport(transport).register_pool(buf)
            self._recv_buffers[transport] = buf
        return buf

    def close(self) -> None:
        """Close every transport this endpoint opened."""
        for t in self._transports.values():
            t.close()
        self._transports.clear()
        self._pool_registered.clear()
