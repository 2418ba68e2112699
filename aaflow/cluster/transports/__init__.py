"""KV transports: move one contiguous CPU tensor between processes, exactly.

Backends (`local`, `ray`, `nixl`, `ucx`) are registered by name and imported only when
used; `available_transports()` says which can run here and why not. A name like
`"ray@10Gbps"` or `"nixl@1Gbps,50us"` gives an `EmulatedLink`: that base, slowed down.

Layer: cluster.
"""

from .base import TransferHandle, TransferStats, Transport, TransportUnavailableError
from .registry import available_transports, get_transport, register_transport
from .emulated import EmulatedLink

__all__ = [
    "EmulatedLink",
    "TransferHandle",
    "TransferStats",
    "Transport",
    "TransportUnavailableError",
    "available_transports",
    "get_transport",
    "register_transport",
]
