"""The built-in engine: a Llama-family model, its tokenizer and a paged KV pool, in one process."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence as Seq

import torch
from transformers import AutoTokenizer

from aaflow.engine.allocator import keep_freed_memory
from aaflow.engine.blend import blend
from aaflow.engine.config import ModelConfig
from aaflow.engine.dtypes import DTYPES, resolve_dtype
from aaflow.engine.fingerprint import model_fingerprint, weights_digest
from aaflow.engine.generation import run_generation
from aaflow.engine.kv_budget import in_process_kv_cache_bytes, parse_bytes
from aaflow.engine.kv_cache import KVLayout
from aaflow.engine.model import LlamaModel
from aaflow.engine.outputs import GenerationOutput
from aaflow.engine.prompt_text import PromptText
from aaflow.engine.runner import KVRunner
from aaflow.engine.sampling import SamplingParams
from aaflow.engine.sequence import KVExport
from aaflow.engine.weights import load_weights
from aaflow.common.errors import ModelNotFoundError
from aaflow.models import resolve_model_path

DETERMINISTIC_DEFAULT = False  # on, batched decode runs markedly slower (`aaflow bench engine`, docs/RESULTS.md)


class Engine(PromptText):
    """A model replica's compute: prefill, decode, and the KV pool they share.

    Build one with `Engine.from_pretrained`. Not thread-safe: one caller at a time.
    """

    def __init__(self, model_path: Path, config: ModelConfig, dtype: torch.dtype, tokenizer,
                 runner: KVRunner) -> None:
        self.model_path = model_path
        self.config = config
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.runner = runner

    @classmethod
    def from_pretrained(
        cls,
        name_or_folder: str | os.PathLike,
        dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | str | None = None,
        prefix_caching: bool = True,
        threads: int | None = None,
        deterministic: bool | None = None,
    ) -> "Engine":
        """Load a registered model (e.g. "smollm2", fetched on first use) or a Hugging Face folder.

        The first engine of a process tunes glibc's malloc to keep freed memory (`allocator.py`;
        `AAFLOW_MALLOC_TUNING=0` opts out).

        Args:
            dtype: "float32", "bfloat16" or "float16" for weights and KV; "auto" (default) is
                bfloat16 on CPUs with native bf16 and float32 on the others (`dtypes.resolve_dtype`).
            block_size: tokens per KV block.
            num_blocks: pool size in blocks; default: as many as fit in `kv_cache_bytes`.
            kv_cache_bytes: the KV pool's size (bytes or "2GiB"); default 256 MiB, or
                `AAFLOW_KV_CACHE_BYTES` (a cluster's replicas get a share of the machine's memory:
                `kv_budget.default_kv_cache_bytes`).
            prefix_caching: reuse full blocks of earlier prompts with the same prefix.
            threads: torch intra-op threads (process-wide); None leaves torch's setting.
            deterministic: batch- and chunk-invariant attention: a token's logits do not depend on
                how its prompt was chunked, packed or batched (`fixed_attention.py`); None: the
                default, `DETERMINISTIC_DEFAULT`.
        """
        dtype = resolve_dtype(dtype)
        keep_freed_memory()
        if threads is not None:
            torch.set_num_threads(threads)
        folder = resolve_model_path(name_or_folder)
        config = ModelConfig.from_folder(folder)
        torch_dtype = DTYPES[dtype]
        weights = load_weights(folder, config, torch_dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"{folder}: tokenizer cannot be loaded ({exc})") from exc
        dtype_bytes = torch.empty((), dtype=torch_dtype).element_size()
        if num_blocks is None:
            kv_cache_bytes = in_process_kv_cache_bytes() if kv_cache_bytes is None else parse_bytes(kv_cache_bytes)
            num_blocks = max(1, kv_cache_bytes // (config.kv_bytes_per_token(dtype_bytes) * block_size))
        layout = KVLayout(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, torch_dtype)
        if deterministic is None:
            deterministic = DETERMINISTIC_DEFAULT
        model = LlamaModel(config, weights, torch_dtype, deterministic)
        fingerprint = model_fingerprint(config, torch_dtype, weights_digest(folder))
        return cls(folder, config, torch_dtype, tokenizer, KVRunner(model, layout, fingerprint, prefix_caching))

    # --- identity -------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """Model fingerprint (architecture, shapes, RoPE, dtype, sha256 of the weights files)."""
        return self.runner.fingerprint

    @property
    def kv_layout(self) -> KVLayout:
        return self.runner.layout

    @property
    def weight_nbytes(self) -> int:
        return self.runner.model.weights.nbytes()

    # --- KV protocol (what operators and replicas build on) --------------------------------
    def new_sequence(self) -> int:
        return self.runner.new_sequence()

    def prefill(self, seq_id: int, token_ids: Seq[int], chunk_size: int | None = None,
                all_logits: bool = False, reuse_prefix: bool = True) -> torch.Tensor:
        """Append tokens to a sequence (incremental prefill); returns the last token's logits [vocab],
        or with `all_logits` those of every token computed (a prefix-cache hit skips some): [n, vocab].
        `reuse_prefix=False` computes every token even when cached blocks match."""
        return self.runner.prefill(seq_id, list(token_ids), chunk_size, all_logits, reuse_prefix)

    def prefill_packed(self, seq_ids: list[int], token_lists: list[list[int]],
                       reuse_prefix: list[bool] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Prefill several sequences together (one forward pass where their prefixes allow): the logits
        of each list's last token [n, vocab] and the tokens each reused from the prefix cache.
        Equal to one `prefill` per sequence, in order."""
        return self.runner.prefill_packed(seq_ids, token_lists, reuse_prefix)

    def decode(self, seq_ids: list[int], token_ids: list[int]) -> torch.Tensor:
        """One token for each sequence in one batched pass; returns logits [B, vocab]."""
        return self.runner.decode(seq_ids, token_ids)

    def fork(self, seq_id: int) -> int:
        return self.runner.fork(seq_id)

    def free(self, seq_id: int) -> None:
        self.runner.free(seq_id)

    def sequence_tokens(self, seq_id: int) -> list[int]:
        return list(self.runner.get(seq_id).token_ids)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.runner.get(seq_id).block_table)

    def export_kv(self, seq_id: int, out: torch.Tensor | None = None) -> KVExport:
        """The sequence's KV, [layers, 2, n, kv_heads, head_dim], copied into `out` if given."""
        return self.runner.export_kv(seq_id, out)

    def import_kv(self, export: KVExport, cacheable: bool = True) -> int:
        """A new sequence holding imported KV (checked first); `cacheable=False` for approximate KV."""
        return self.runner.import_kv(export, cacheable)

    @property
    def kv_pool(self) -> torch.Tensor:
        """The pool tensor every sequence's KV lives in (one contiguous buffer: register it once)."""
        return self.runner.cache.tensor

    def kv_segments(self, seq_id: int) -> list[tuple[int, int]]:
        """(address, nbytes) of the pool memory holding the sequence's KV, in `export_kv`'s order."""
        return self.runner.cache.byte_segments(self.runner.kv_slots(seq_id))

    def reserve_kv(self, fingerprint: str, token_ids: Seq[int], cacheable: bool = True) -> int:
        """A new sequence with pool blocks for `token_ids` and no KV yet: write it in place (at
        `kv_segments`), then `seal_kv`, or `free` it. Refuses another model's fingerprint."""
        return self.runner.reserve_kv(fingerprint, list(token_ids), cacheable)

    def check_room(self, num_tokens: int) -> None:
        """Raise `KVImportError` / `KVCapacityError` if `num_tokens` of KV cannot be imported now."""
        self.runner.check_room(num_tokens)

    def seal_kv(self, seq_id: int) -> None:
        """Mark a reserved sequence's KV written: its full blocks may now serve prefix-cache hits."""
        self.runner.seal_kv(seq_id)

    def shift_keys(self, kv: torch.Tensor, delta: int) -> torch.Tensor:
        """kv [layers, 2, n, kv_heads, head_dim] with keys re-rotated by `delta` positions (values
        unchanged): a new tensor of the same shape."""
        return self.runner.model.rotary.shift_kv(kv, delta)

    def blend(self, seq_id: int, candidate_positions: list[int], fraction: float, anchors: list[int] = ()):
        """Recompute `fraction` of the candidate positions in place, `anchors` first, then the most
        deviating ones (a `BlendResult`)."""
        return blend(self.runner, seq_id, candidate_positions, fraction, anchors)

    def clear_prefix_cache(self) -> None:
        """Forget cached prefixes (benchmarks start each measurement cold)."""
        self.runner.blocks.clear_cache()

    def stats(self):
        """Blocks used / free / cached and tokens computed vs reused (a `BlockStats`)."""
        return self.runner.stats()

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompt: str | Seq[int], max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop: Seq[str] | None = None,
                 ignore_eos: bool = False, chunk_size: int | None = None) -> GenerationOutput:
        """Generate from a prompt (text, encoded with the tokenizer's special tokens, or token ids).

        Greedy by default. The sequence is freed afterwards; its full blocks stay in the prefix cache.
        """
        params = SamplingParams(max_new_tokens, temperature, top_p, seed, tuple(stop or ()), ignore_eos)
        return self.generate_batch([prompt], params, chunk_size=chunk_size)[0]

    def generate_batch(self, prompts: Seq[str | Seq[int]], params: SamplingParams | None = None,
                       chunk_size: int | None = None, seq_ids: list[int] | None = None,
                       keep: bool = False) -> list[GenerationOutput]:
        """Prefill each prompt, then decode all of them together in batched steps.

        With `seq_ids`, each prompt is appended to that existing sequence (continuation).
        With `keep`, sequences are not freed and each output's `seq_id` names its sequence.
        """
        params = params or SamplingParams()
        start = time.perf_counter()
        ids = [self.prompt_ids(p) for p in prompts]
        own = seq_ids is None
        seq_ids = [self.new_sequence() for _ in ids] if own else list(seq_ids)
        try:
            return run_generation(self, seq_ids, ids, params, chunk_size, start, keep)
        finally:
            if own and not keep:
                for s in seq_ids:
                    if s in self.runner.sequences:
                        self.free(s)
