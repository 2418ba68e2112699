"""What a run needs of its models' text before it starts: a prompt builder per model (its tokenizer,
loaded once per process), end-of-sequence ids and position limits, and the size check that refuses
a prompt no position range or KV pool can hold."""

from __future__ import annotations

import functools
import threading

from transformers import AutoTokenizer

from aaflow.engine.config import ModelConfig
from aaflow.common.errors import WorkflowError
from aaflow.models import resolve_model_path
from aaflow.runtime.prompts import AgentInput, PromptBuilder


def prompt_builders(models: set[str]) -> tuple[dict, dict, dict]:
    """Per model: a prompt builder (fresh: its tokenization memo lasts one run), its end-of-sequence
    token ids and its position limit."""
    builders, eos, limits = {}, {}, {}
    for model in models:
        with _LOADING:  # runs start from many threads; transformers' lazy imports are not thread-safe
            tokenizer, lock, eos[model], limits[model] = _model_text(model)
        builders[model] = PromptBuilder(tokenizer, lock)
    return builders, eos, limits


_LOADING = threading.Lock()


@functools.lru_cache(maxsize=16)
def _model_text(model: str) -> tuple[object, threading.Lock, set[int], int]:
    """A model's tokenizer (loaded once per process, like the replicas' weights), the
    lock its callers share (runs from several threads use it), end-of-sequence ids and position limit."""
    folder = resolve_model_path(model, quiet=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = ModelConfig.from_folder(folder)
    eos = set(config.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
    return tokenizer, threading.Lock(), eos, config.max_position_embeddings


def check_sizes(wf, builders, limits, cluster=None) -> None:
    """Refuse prompts that cannot fit the model's positions, counting upstream outputs at their
    max, and (given a live cluster) prompts that no replica's KV pool could hold even alone."""
    pools: dict[str, int] = {}
    for r in cluster.replicas() if hasattr(cluster, "info") else []:
        info = cluster.info.get(r.name, {})
        if info.get("kv_blocks"):
            pools[r.model] = max(pools.get(r.model, 0), info["kv_blocks"] * info.get("block_size", 16))
    for agent in wf.agents():
        prompt = 0
        for seg in builders[agent.model].segments(wf, agent):
            prompt += wf.nodes[seg.agent].max_tokens if isinstance(seg, AgentInput) else len(seg)
        total = prompt + agent.max_tokens
        if total > limits[agent.model]:
            raise WorkflowError(
                f"agent {agent.name!r}: prompt plus output can reach {total} tokens, beyond model "
                f"{agent.model!r}'s {limits[agent.model]} positions; shorten its contexts or max_tokens"
            )
        if agent.model in pools and prompt + 1 > pools[agent.model]:
            raise WorkflowError(
                f"agent {agent.name!r}: its prompt can reach {prompt} tokens, more than the KV pool of any "
                f"replica of {agent.model!r} holds ({pools[agent.model]} tokens); start the cluster with a "
                "larger kv_cache_bytes (af.init, --kv-cache-bytes or AAFLOW_KV_CACHE_BYTES) or shorten it"
            )
