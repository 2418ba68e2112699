"""KV transports: move one contiguous CPU tensor between processes, exactly.

Backends (`local`, `ray`, `nixl`, `ucx`) are registered by name and imported only when
used; `available_transports()` says which can run here and why not.
"""

from .base import (
    TransferHandle,
    TransferStats,
    Transport,
    TransportUnavailableError,
    available_transports,
    get_transport,
    register_transport,
)

__all__ = [
    "TransferHandle",
    "TransferStats",
    "Transport",
    "TransportUnavailableError",
    "available_transports",
    "get_transport",
    "register_transport",
]
