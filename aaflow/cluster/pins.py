"""`af.pin(cluster, text, ttl_s=...)`: keep a document's KV on a deployment's replicas, as the start
of an agent prompt, so that workflows from any client reuse it until the pin expires.

The pinned KV is a ref on each replica (materialized there, exact): while pinned, budget
eviction skips it and its blocks stay in use, so the prefix cache cannot drop them; when the TTL
runs out the replica evicts the ref before its next call and its blocks join the prefix cache,
reusable until the pool needs them for something else.
"""

from __future__ import annotations

from aaflow.common.errors import ModelMismatchError
from aaflow.runtime import prompt_builders
from aaflow.cluster.cluster import Cluster, ReplicaHandle
from aaflow.cluster.remote import RemoteKVRef, materialize, pin


def prompt_prefix(model: str, text: str, system: str | None = None) -> list[int]:
    """The token ids an agent of `model` whose prompt starts with context `text` prefills first:
    the chat template's header (with `system`) and the text (`PromptBuilder.segments` joins them so)."""
    builder = prompt_builders({model})[0][model]  # the process's tokenizer for `model`, loaded once
    head, _ = builder.frame(system)
    return list(head + builder.ids(text))


def pin_context(cluster: Cluster, text: str, ttl_s: float | None = None, model: str | None = None,
                system: str | None = None, replicas: list[ReplicaHandle] | None = None) -> list[RemoteKVRef]:
    """Pin `text` as a prompt's leading context on `replicas` (default: every replica of `model`;
    `model` may be left out when the cluster serves one), for `ttl_s` seconds (None: until
    `af.unpin`). Returns the pinned refs, one per replica."""
    served = sorted(cluster.models)
    if model is None:
        if len(served) != 1:
            raise ModelMismatchError(f"the cluster serves {served}: say which with model=")
        model = served[0]
    targets = replicas or cluster.replicas(model)
    if not targets or any(r.model != model for r in targets):
        raise ModelMismatchError(f"no replica of {model!r} to pin on (the cluster serves {served})")
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0 seconds or None (until unpinned), got {ttl_s}")
    ids = prompt_prefix(model, text, system)
    refs = [materialize(cluster, model, ids, replica=r) for r in targets]
    for ref in refs:
        pin(ref, ttl_s)
    return refs
