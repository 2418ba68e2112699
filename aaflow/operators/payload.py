"""`KVPayload`: KV bytes in flight (composed, spilled or received), in the engine's export format.

Engines accept any object with these three fields in `import_kv`; operators build their own so
that they never import a concrete engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVPayload:
    fingerprint: str
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # [num_layers, 2, len(token_ids), num_kv_heads, head_dim]
