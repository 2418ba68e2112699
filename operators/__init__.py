"""The KV object model (KVSpec, KVRef, lineage) and the five stateful operators.

Operators work against the small KV protocol of `operators.protocol` (implemented by the
built-in engine) and know nothing of Ray or of a concrete engine.
"""

from operators.compose import compose
from operators.evict import evict, free, pin, unpin
from operators.fork import fork
from operators.host import EvictionPolicy, KVHost
from operators.materialize import extend, materialize
from operators.payload import KVPayload
from operators.ref import FidelityReport, KVRef, Lineage
from operators.spec import KVSpec
from operators.transfer import transfer

__all__ = [
    "EvictionPolicy", "FidelityReport", "KVHost", "KVPayload", "KVRef", "KVSpec", "Lineage",
    "compose", "evict", "extend", "fork", "free", "materialize", "pin", "transfer", "unpin",
]
