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
import numbers
from dataclasses import dataclass

import torch

from aaflow.errors import AAFlowError, KVImportError, KVTransferError, ModelMismatchError
from cluster.ref_table import RefRecord
from cluster.transports import get_transport
from cluster.transports.base import TransferStillRunningError
from operators import FidelityReport, KVPayload, Lineage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVShape:
    """What a receiver checks before any byte lands: model, geometry and dtype."""

    fingerprint: str
    shape: tuple[int, ...]  # [layers, 2, tokens, kv_heads, head_dim]
    dtype: str


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
    def expose(self, ref_id: str, transport: str) -> tuple[object, KVShape, object]:
        """Make the ref's KV readable by a peer; returns (handle, shape to check, record).

        In place where the transport allows (the exposed blocks are held by a fork until
        `release`, so the ref may be freed or extended meanwhile); otherwise gathered once into a
        registered staging buffer that is reused after `release`.
        """
        self.faults.reached("expose")
        handle, kv_shape, record = self._expose(ref_id, transport)
        if self.faults.stale_exposure():  # fault injection: the peer will meet a released exposure
            self.release(handle, transport)
        return handle, kv_shape, record

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
    def receive(self, handle, shape: KVShape, record, transport: str, timeout_s: float = 30.0):
        """Pull a peer's exposed KV and import it as a new ref here; returns (record, TransferStats).

        The fingerprint, shape and dtype are checked before any byte is received; a failed fetch
        raises `KVTransferError` and leaves this pool exactly as it was.
        """
        self.faults.maybe_fail("receive")
        check_descriptor(handle, shape, record)
        if shape.fingerprint != self.engine.fingerprint:
            raise ModelMismatchError(
                f"replica {self.name} serves model {self.engine.fingerprint[:12]}..., the KV is of model "
                f"{shape.fingerprint[:12]}...; recompute from text instead"
            )
        lay = self.engine.kv_layout
        expected = (lay.num_layers, 2, len(record.token_ids), lay.num_kv_heads, lay.head_dim)
        dtype = getattr(torch, shape.dtype, None)
        if tuple(shape.shape) != expected or dtype != lay.dtype:
            raise KVImportError(f"incoming KV {shape.shape} {shape.dtype} does not match this replica's "
                                f"{expected} {str(lay.dtype).removeprefix('torch.')}")
        declared = torch.Size(expected).numel() * lay.dtype_bytes  # the only size this replica will allocate
        if record.nbytes != declared or handle.nbytes != declared:
            raise KVImportError(f"incoming KV of {len(record.token_ids)} tokens is {declared} bytes here, but the ref "
                                f"declares {record.nbytes} and the transfer handle {handle.nbytes}: a damaged or "
                                "forged descriptor; nothing was allocated (recompute from text)")
        self.engine.check_room(len(record.token_ids))  # before a receive buffer or pool blocks are taken
        in_place = self._in_place(transport)
        fetch = self._fetch_in_place if in_place is not None else self._fetch_staged
        seq, stats = _as_transfer_error(transport, self.name,
                                        lambda: fetch(handle, shape, record, transport, timeout_s))
        lineage = Lineage("transfer", (record.id,), (("from", record.replica), ("transport", transport)))
        return self.refs.add(self.host.register(seq, lineage, record.fidelity)), stats

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


def check_descriptor(handle, shape, record) -> None:
    """`KVImportError` unless a received descriptor has the types a sender makes: a handle with an int
    `nbytes`, a `KVShape` of strings and ints, a record whose token ids are ints and `nbytes` an int.
    Runs before the receiver looks at sizes, so a malformed one cannot reach an allocation."""
    def is_int(x) -> bool:  # Python or numpy integers
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)

    problems = []
    if not is_int(getattr(handle, "nbytes", None)):
        problems.append(f"handle {type(handle).__name__} has no integer nbytes")
    if not (isinstance(shape, KVShape) and isinstance(shape.fingerprint, str) and isinstance(shape.dtype, str)
            and isinstance(shape.shape, tuple) and all(is_int(d) and d >= 0 for d in shape.shape)):
        problems.append(f"shape {shape!r:.120} is not a KVShape of a fingerprint, dims and a dtype name")

    if not (isinstance(record, RefRecord) and isinstance(record.id, str) and isinstance(record.replica, str)
            and isinstance(record.token_ids, tuple) and record.token_ids and all(is_int(t) for t in record.token_ids)
            and is_int(record.nbytes) and (record.fidelity is None or isinstance(record.fidelity, FidelityReport))):
        problems.append(f"record {record!r:.120} is not a RefRecord with an id, non-empty integer token ids and "
                        "an integer nbytes")
    if problems:
        raise KVImportError("malformed KV transfer descriptor: " + "; ".join(problems)
                            + "; pass what the source replica's expose returned")


def _as_transfer_error(transport: str, replica: str, call):
    """Run `call`; any transport failure becomes one typed `KVTransferError`."""
    try:
        return call()
    except AAFlowError:  # already typed (KVTransferError, KVCapacityError, ...)
        raise
    except Exception as exc:  # noqa: BLE001 - any transport failure becomes one typed error
        raise KVTransferError(f"{transport} transfer to {replica} failed: {exc}") from exc
