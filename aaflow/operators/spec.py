"""`KVSpec`: the shape of a model's KV, enough to size, check and move it."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVSpec:
    """Per-model KV geometry.

    Attributes:
        num_layers: decoder layers.
        num_kv_heads: key/value heads per layer.
        head_dim: channels per head.
        block_size: tokens per block of the pool that holds it.
        dtype: "float32", "bfloat16" or "float16".
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"KVSpec.dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers: layers x 2 x kv_heads x head_dim x dtype bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @classmethod
    def of(cls, engine) -> "KVSpec":
        """The spec of an engine implementing the KV protocol (it has a `kv_layout`)."""
        lay = engine.kv_layout
        return cls(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, str(lay.dtype).removeprefix("torch."))
