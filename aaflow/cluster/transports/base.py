"""The `Transport` contract, its handle and stats types, and the lazy backend registry.

A transport moves one contiguous CPU tensor (a sequence's exported KV,
`[layers, 2, tokens, kv_heads, head_dim]`, bf16 or fp32) from the process that holds it
to another process, bit for bit. Roles:

- source side: `expose(tensor) -> TransferHandle`, later `release(handle)`;
- destination side: `fetch(handle, out) -> TransferStats` fills a preallocated `out`;
- either side: `register_pool(tensor)` (optional), `close()`;
- where `supports_segments` (`nixl`): `expose_segments` / `fetch_segments` move a scatter list of
  a registered pool (a sequence's KV where it lies in the pool) with no staging copy.

The handle is small and picklable; callers carry it out of band (a Ray call argument).
Every transport endpoint can play both roles; one instance per process is the norm.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from aaflow.common.errors import KVTransferError

from .segments import Segments, check_inside, total_nbytes


_LIVE: "weakref.WeakSet[Transport]" = weakref.WeakSet()  # every endpoint of this process, for leak checks


def open_transports() -> list["Transport"]:
    """Endpoints of this process that were created and not closed yet (a leak check's view)."""
    return [t for t in list(_LIVE) if not t._closed]


class TransportUnavailableError(KVTransferError):
    """A transport backend cannot run in this environment (package missing, no Ray, ...)."""


class TransferStillRunningError(KVTransferError):
    """A failed fetch whose copy could not be cancelled: the destination memory may still be
    written, so it must not be reused (a replica keeps those pool blocks out of use)."""


@dataclass(frozen=True)
class TransferHandle:
    """What a destination needs to fetch one exposed tensor; small and picklable.

    Backends subclass it (still frozen) to add their own fields (agent metadata,
    addresses, an ObjectRef). A handle stays valid until the source calls `release`.
    """

    transport: str
    """Name of the transport that made it (`Transport.name`)."""
    handle_id: str
    """Unique id of this exposure (uuid4 hex); the source looks exposures up by it."""
    nbytes: int
    """Size of the exposed tensor in bytes; `out` must have exactly this many."""
    shape: tuple[int, ...]
    """Shape of the exposed tensor."""
    dtype: str
    """Dtype of the exposed tensor without the `torch.` prefix, e.g. `"bfloat16"`."""


@dataclass(frozen=True)
class TransferStats:
    """One completed fetch, measured on the destination: the wall clock around `fetch`,
    handshake included (for a small tensor, `seconds` is the transport's latency)."""

    transport: str
    """Name of the transport that moved the bytes."""
    nbytes: int
    """Bytes copied into `out`."""
    seconds: float
    """Wall-clock seconds of the whole fetch."""

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Effective bandwidth of this fetch, bytes per second."""
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


class Transport(ABC):
    """Moves one contiguous CPU tensor between processes, exactly.

    Subclasses set `name` and `handle_type` and implement `expose`, `_fetch`, `release`
    and `close`; `fetch` itself is final here (it validates, times, wraps errors).
    """

    name: ClassVar[str]
    handle_type: ClassVar[type[TransferHandle]] = TransferHandle

    def __init__(self) -> None:
        self.num_registrations = 0
        """Memory registrations this endpoint has made (tests check that fetches reuse them)."""
        self._closed = False
        _LIVE.add(self)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (a missing package...), or None.

        Cheap: it must not import the heavy package behind the backend."""
        return None

    # -- source side ---------------------------------------------------------------------------

    @abstractmethod
    def expose(self, tensor: torch.Tensor) -> TransferHandle:
        """Make a contiguous, non-empty CPU tensor readable by peers; return its handle.

        Blocking (registration, or a copy into a store for `ray`); may be called again on
        the same tensor, each call giving an independent handle. The caller must keep the
        tensor alive and unchanged until `release(handle)`; the transport also keeps a
        reference. Raises ValueError for a tensor it cannot expose.
        """

    @abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Stop exposing `handle`'s tensor; later fetches of it raise KVTransferError.

        Idempotent and non-blocking: a fetch already in flight finishes first (the
        transport defers freeing the registration until then). Unknown handles are ignored.
        """

    def register_pool(self, tensor: torch.Tensor) -> None:
        """Optionally register a whole contiguous CPU buffer (a replica's KV pool) once.

        Later `expose`s of tensors inside it, and `fetch`es into `out`s inside it, then
        skip per-call registration. The caller keeps the pool alive until `close()`.
        Calling it twice on the same buffer is a no-op. Default: nothing to register.
        """
        _check_cpu_contiguous(tensor, "pool")

    def unregister_pool(self, tensor: torch.Tensor) -> None:
        """Undo `register_pool` (e.g. before replacing a buffer with a bigger one).

        Release the exposures inside the pool, and let fetches into it finish, first.
        Non-blocking; buffers that are not registered pools are ignored. Default: nothing.
        """
        return None

    # -- destination side ----------------------------------------------------------------------

    def fetch(
        self, handle: TransferHandle, out: torch.Tensor, timeout_s: float = 30.0
    ) -> TransferStats:
        """Fill `out` with the bytes of the peer's exposed tensor; return timing.

        Blocking; may be called any number of times on one handle, and from several
        threads (`nixl` runs them one at a time).
        `out` must be a contiguous CPU tensor of exactly `handle.nbytes` bytes (its dtype
        and shape are not checked: the copy is byte for byte). On any failure or after
        `timeout_s` raises KVTransferError; `out` must then be discarded.
        """
        self._check_handle(handle, out)
        return self._timed(handle, timeout_s, lambda deadline: self._fetch(handle, out, deadline))

    # -- scattered memory (optional: `supports_segments`) --------------------------------------

    supports_segments: ClassVar[bool] = False
    """True when the backend reads and writes scatter lists of a registered pool in place."""

    def expose_segments(self, pool: torch.Tensor, segments: Segments, shape: tuple[int, ...],
                        dtype: torch.dtype) -> TransferHandle:
        """Expose the byte stream made of `segments` of a `register_pool`ed `pool` (logically a
        tensor of `shape` and `dtype`) without copying it. The caller keeps those bytes unchanged
        until `release`. Only where `supports_segments`."""
        raise NotImplementedError(f"{self.name} cannot expose scattered memory; expose() a contiguous copy")

    def fetch_segments(self, handle: TransferHandle, pool: torch.Tensor, segments: Segments,
                       timeout_s: float = 30.0) -> TransferStats:
        """Like `fetch`, but write the exposed bytes straight into `segments` of a
        `register_pool`ed `pool` (their total must be `handle.nbytes`). On failure the segments
        hold undefined bytes. Only where `supports_segments`."""
        if not self.supports_segments:
            raise NotImplementedError(f"{self.name} cannot write scattered memory; fetch() into a buffer")
        self._check_handle(handle, pool, check_size=False)
        check_inside(segments, pool, f"{self.name}: fetch_segments")
        if total_nbytes(segments) != handle.nbytes:
            raise KVTransferError(f"{self.name}: segments hold {total_nbytes(segments)} bytes, the handle "
                                  f"exposes {handle.nbytes}")
        return self._timed(handle, timeout_s,
                           lambda deadline: self._fetch_segments(handle, pool, segments, deadline))

    def _fetch_segments(self, handle: TransferHandle, pool: torch.Tensor, segments: Segments,
                        deadline: float) -> None:
        """Backend part of `fetch_segments` (validated arguments, monotonic deadline)."""
        raise NotImplementedError

    def _timed(self, handle: TransferHandle, timeout_s: float, call) -> TransferStats:
        """Run `call(deadline)`, wrapping any backend error into KVTransferError; time it."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        start = time.perf_counter()
        try:
            call(time.monotonic() + timeout_s)
        except KVTransferError:
            raise
        except Exception as err:  # a backend error of any kind is a failed transfer
            raise KVTransferError(
                f"{self.name}: fetch of {handle.nbytes} bytes (handle {handle.handle_id}) "
                f"failed: {err!r}"
            ) from err
        return TransferStats(self.name, handle.nbytes, time.perf_counter() - start)

    @abstractmethod
    def _fetch(self, handle: TransferHandle, out: torch.Tensor, deadline: float) -> None:
        """Backend part of `fetch`: handle and `out` are validated; `deadline` is monotonic."""

    # -- lifecycle -----------------------------------------------------------------------------

    @abstractmethod
    def close(self) -> None:
        """Release every exposure and registration and stop background threads. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for backends ------------------------------------------------------------------

    def _new_handle_fields(self, tensor: torch.Tensor) -> dict[str, Any]:
        """Common handle fields for a tensor about to be exposed (validates it)."""
        if self._closed:
            raise KVTransferError(f"{self.name}: transport is closed; create a new one")
        _check_cpu_contiguous(tensor, "tensor")
        if tensor.nbytes == 0:
            raise ValueError("cannot expose an empty tensor: there is nothing to transfer")
        return dict(
            transport=self.name,
            handle_id=uuid.uuid4().hex,
            nbytes=tensor.nbytes,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
        )

    def _check_handle(self, handle: object, out: torch.Tensor, check_size: bool = True) -> None:
        if self._closed:
            raise KVTransferError(f"{self.name}: transport is closed; create a new one")
        if not isinstance(handle, self.handle_type) or handle.transport != self.name:
            got = getattr(handle, "transport", type(handle).__name__)
            raise KVTransferError(
                f"{self.name}: not a {self.handle_type.__name__} (got {got!r}); pass the "
                f"handle returned by expose() of a '{self.name}' transport"
            )
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or not out.is_contiguous():
            raise KVTransferError(f"{self.name}: out must be a contiguous CPU tensor")
        if check_size and out.nbytes != handle.nbytes:
            raise KVTransferError(
                f"{self.name}: out has {out.nbytes} bytes ({tuple(out.shape)}, {out.dtype}) but "
                f"the exposed tensor has {handle.nbytes} ({handle.shape}, {handle.dtype})"
            )


def _check_cpu_contiguous(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous CPU tensor (got {tensor.device}, "
            f"contiguous={tensor.is_contiguous()}); call .contiguous() first"
        )


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy); works for bf16, which numpy lacks."""
    return tensor.reshape(-1).view(torch.uint8)


def package_missing(*modules: str) -> str | None:
    """The first of `modules` that is not installed, as a reason string, else None (no import)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"package providing '{module}' is not installed"
    return None
