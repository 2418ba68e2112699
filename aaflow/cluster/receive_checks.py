"""What a replica checks of incoming KV before any byte lands, whatever its engine: the
descriptor's types, the model fingerprint, the geometry and dtype, and the byte count it will
allocate. The built-in replica's transfer endpoint and the vLLM replica both receive through it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from aaflow.common.errors import AAFlowError, KVImportError, KVTransferError, ModelMismatchError
from aaflow.runtime.replies import RefRecord
from aaflow.operators import FidelityReport


@dataclass(frozen=True)
class KVShape:
    """What a receiver checks before any byte lands: model, geometry and dtype."""

    fingerprint: str
    shape: tuple[int, ...]  # [layers, 2, tokens, kv_heads, head_dim]
    dtype: str


@dataclass(frozen=True)
class ReceiverGeometry:
    """The receiving replica's side of the checks: its name (for messages), model fingerprint, KV
    geometry and dtype, and the most tokens one ref may hold there (None: no limit of its own)."""

    name: str
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_tokens: int | None = None


def check_incoming(handle, shape, record, receiver: ReceiverGeometry) -> tuple[int, ...]:
    """The dims [layers, 2, tokens, kv_heads, head_dim] the incoming KV has here, once the descriptor
    (`check_descriptor`), the fingerprint (`ModelMismatchError`), the dims and dtype and the declared
    bytes (`KVImportError`) are what this replica expects. Allocates nothing."""
    check_descriptor(handle, shape, record)
    if shape.fingerprint != receiver.fingerprint:
        raise ModelMismatchError(f"replica {receiver.name} serves model {receiver.fingerprint[:12]}..., the KV is of "
                                 f"model {shape.fingerprint[:12]}...; recompute from text instead")
    tokens = len(record.token_ids)
    expected = (receiver.num_layers, 2, tokens, receiver.num_kv_heads, receiver.head_dim)
    own_dtype = str(receiver.dtype).removeprefix("torch.")
    if tuple(shape.shape) != expected or getattr(torch, shape.dtype, None) != receiver.dtype:
        raise KVImportError(f"incoming KV {shape.shape} {shape.dtype} does not match replica {receiver.name}'s "
                            f"{expected} {own_dtype}")
    declared = torch.Size(expected).numel() * receiver.dtype.itemsize  # the only size this replica allocates
    if record.nbytes != declared or handle.nbytes != declared:
        raise KVImportError(f"incoming KV of {tokens} tokens is {declared} bytes here, but the ref declares "
                            f"{record.nbytes} and the transfer handle {handle.nbytes}: a damaged or forged "
                            "descriptor; nothing was allocated (recompute from text)")
    if receiver.max_tokens is not None and tokens > receiver.max_tokens:
        raise KVImportError(f"incoming KV of {tokens} tokens is longer than replica {receiver.name}'s "
                            f"{receiver.max_tokens} positions; nothing was allocated (recompute from text)")
    return expected


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


def as_transfer_error(transport: str, replica: str, fetch):
    """Run `fetch`; any transport failure becomes one typed `KVTransferError`."""
    try:
        return fetch()
    except AAFlowError:  # already typed (KVTransferError, KVCapacityError, ...)
        raise
    except Exception as exc:  # noqa: BLE001 - any transport failure becomes one typed error
        raise KVTransferError(f"{transport} transfer to {replica} failed: {exc}") from exc
