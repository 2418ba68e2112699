"""The KV object model (KVSpec, KVRef, lineage) and the five stateful operators.

Operators work against the small KV protocol of `aaflow.operators.protocol` (implemented by the
built-in engine) and know nothing of Ray or of a concrete engine.

Layer: core.
"""

from aaflow.operators.compose import compose
from aaflow.operators.evict import evict, free, pin, unpin
from aaflow.operators.fork import fork
from aaflow.operators.host import EvictionPolicy, KVHost
from aaflow.operators.materialize import extend, materialize
from aaflow.operators.payload import KVPayload
from aaflow.operators.ref import FidelityReport, KVRef, Lineage
from aaflow.operators.spec import KVSpec
from aaflow.operators.transfer import transfer

__all__ = [
    "EvictionPolicy", "FidelityReport", "KVHost", "KVPayload", "KVRef", "KVSpec", "Lineage",
    "compose", "evict", "extend", "fork", "free", "materialize", "pin", "transfer", "unpin",
]
