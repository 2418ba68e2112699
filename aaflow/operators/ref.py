"""`KVRef`: the immutable handle operators take and return. Users never touch tensors."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from aaflow.common.errors import InvalidArgumentError
from aaflow.operators.spec import KVSpec

if TYPE_CHECKING:
    from aaflow.operators.host import KVHost

_counter = itertools.count(1)


def new_ref_id() -> str:
    return f"kv-{os.getpid()}-{next(_counter)}"


@dataclass(frozen=True)
class Lineage:
    """How a KVRef was made: enough to rebuild it from text at any time.

    Attributes:
        op: the operator that made it.
        parents: ids of the refs it was made from.
        detail: operator parameters, as sorted (key, value) pairs.
    Rebuilding prefills the ref's token ids from scratch, which reproduces every exact ref and
    upgrades an approximate (rerotated / blended) one to the exact KV.
    """

    op: Literal["materialize", "fork", "transfer", "compose", "generate", "import"]
    parents: tuple[str, ...] = ()
    detail: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class FidelityReport:
    """What an approximate compose did, and (when checked) how far it is from a full recompute.

    Attributes:
        mode: "rerotate" or "blend".
        exact: always False for these modes; approximate KV never pretends to be exact.
        recomputed_tokens / total_tokens: tokens recomputed by blend, and the composed length.
        mean_deviation: blend's mean relative layer-1 K/V change over the re-placed tokens.
        top1_agreement / kl_divergence: over the probe's positions, the fraction of top-1 next tokens
            equal to a full recompute's and the mean KL(recompute || composed); filled only when
            compose was asked to check.
    """

    mode: str
    exact: bool = False
    recomputed_tokens: int = 0
    total_tokens: int = 0
    mean_deviation: float | None = None
    top1_agreement: float | None = None
    kl_divergence: float | None = None


@dataclass(frozen=True, eq=False)
class KVRef:
    """A handle to KV for the context `token_ids` (positions 0..n-1) living on `host`.

    Attributes:
        id: unique id.
        fingerprint: model fingerprint of the KV (architecture, weights hash, dtype, RoPE).
        token_ids: the context tokens.
        host: where the KV lives (`replica` names it).
        block_table: blocks holding it at creation time (a snapshot, for inspection).
        spec: KV geometry.
        lineage: how it was made; None when lineage was disabled (then eviction is final).
        fidelity: set when the KV is approximate (rerotate / blend compose).
    """

    id: str
    fingerprint: str
    token_ids: tuple[int, ...]
    host: "KVHost" = field(repr=False)
    block_table: tuple[int, ...]
    spec: KVSpec
    lineage: Lineage | None
    fidelity: FidelityReport | None = None

    @property
    def replica(self) -> str:
        """Name of the replica / engine host holding this KV."""
        return self.host.name

    @property
    def positions(self) -> tuple[int, int]:
        return (0, len(self.token_ids))

    @property
    def nbytes(self) -> int:
        return len(self.token_ids) * self.spec.bytes_per_token

    @property
    def exact(self) -> bool:
        return self.fidelity is None

    def __len__(self) -> int:
        return len(self.token_ids)


def check_ref(kv, op: str) -> KVRef:
    """`kv` itself if it is a `KVRef`; else `InvalidArgumentError` naming the operator and what it got."""
    if not isinstance(kv, KVRef):
        raise InvalidArgumentError(f"{op} needs a KVRef (from af.materialize, fork, transfer or compose), "
                                   f"got {type(kv).__name__}: {kv!r:.80}")
    return kv
