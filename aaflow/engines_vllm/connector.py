"""`AAFlowConnector`: vLLM's KV connector API speaking aaflow's KV export format (vLLM process only).

A request opts in through `SamplingParams(extra_args={"kv_transfer_params": {...}})`:
  * "aaflow_save": PATH  -> once the prompt is fully computed, the KV of every prompt token is
    written to PATH as an aaflow KV file (`kvfile`), [layers, 2, n, kv_heads, head_dim].
  * "aaflow_load": PATH  -> KV in the aaflow KV file at PATH whose token ids are a prefix of the
    prompt is loaded into the request's paged blocks, so vLLM computes only the rest. The file's
    fingerprint, shape and dtype are checked before anything is written; on a mismatch nothing
    is loaded and the reason is written to PATH + ".refused" (the server reports it).
Scheduler side decides what moves (`get_num_new_matched_tokens`, `build_connector_meta`); worker
side moves bytes synchronously (`start_load_kv` before the forward, `wait_for_save` after it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger

from aaflow.engines_vllm.errors import VLLMKVLayoutError
from aaflow.engines_vllm.kvfile import dtype_name, read_kv_file, read_kv_header, write_kv_file
from aaflow.engines_vllm.layout import CPUBlockLayout

logger = init_logger(__name__)
CONNECTOR_NAME = "AAFlowConnector"
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class KVMove:
    """One load or save for one request: tokens [start, stop) at `slots`."""

    path: str
    token_ids: list[int]
    start: int
    stop: int
    slots: torch.Tensor  # [stop - start] int64


@dataclass
class AAFlowConnectorMetadata(KVConnectorMetadata):
    loads: list[KVMove] = field(default_factory=list)
    saves: list[KVMove] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of a request that asked for a save."""

    path: str
    prompt: list[int]
    block_ids: list[int]
    num_computed: int = 0


def _slots(block_ids: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(start, stop)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


class AAFlowConnector(KVConnectorBase_V1):
    """Loads/saves request KV from/to aaflow KV files. extra_config: {"fingerprint": str}."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        model = vllm_config.model_config
        self._block_size = vllm_config.cache_config.block_size
        self._fingerprint = self._kv_transfer_config.get_from_extra_config("fingerprint", "")
        self._num_layers = model.get_num_layers(vllm_config.parallel_config)
        self._num_kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        self._head_dim = model.get_head_size()
        self._dtype = model.dtype
        self._cache_dtype = vllm_config.cache_config.cache_dtype
        # scheduler side
        self._to_load: dict[str, KVMove] = {}
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._caches: list[torch.Tensor] = []
        self._layer_names: list[str] = []
        self._layout = None
        self._unsupported: str | None = None  # why this cache layout cannot be converted (e.g. CUDA)

    # ---------------- scheduler side ----------------
    def _refuse(self, path: str, reason: str) -> tuple[int, bool]:
        logger.error("AAFlowConnector refuses %s: %s", path, reason)
        Path(f"{path}.refused").write_text(reason)
        return 0, False

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        path = params.get("aaflow_load")
        if not path:
            return 0, False
        header = read_kv_header(path)
        expected = (self._num_layers, 2, len(header.token_ids), self._num_kv_heads, self._head_dim)
        if header.fingerprint != self._fingerprint:
            return self._refuse(path, f"KV fingerprint {header.fingerprint[:16]}... is not this model's "
                                      f"{self._fingerprint[:16]}...")
        if header.shape != expected:
            return self._refuse(path, f"KV shape {header.shape} does not match this model's {expected}")
        if header.dtype != dtype_name(self._dtype) or self._cache_dtype != "auto":
            return self._refuse(path, f"KV dtype {header.dtype} does not match vLLM's cache "
                                      f"({self._dtype}, kv_cache_dtype={self._cache_dtype})")
        prompt = list(request.prompt_token_ids or [])
        common = 0
        for a, b in zip(header.token_ids, prompt):
            if a != b:
                break
            common += 1
        stop = min(common, len(prompt) - 1)  # vLLM computes at least the last prompt token
        if stop <= num_computed_tokens:
            return 0, False
        self._to_load[request.request_id] = KVMove(path, list(header.token_ids), num_computed_tokens, stop,
                                                   torch.empty(0, dtype=torch.long))
        return stop - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        move = self._to_load.get(request.request_id)
        if move is not None:
            if num_external_tokens > 0:
                move.start = move.stop - num_external_tokens
            else:
                del self._to_load[request.request_id]

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = AAFlowConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            move = self._to_load.pop(req.req_id, None)
            if move is not None:
                move.slots = _slots(block_ids, move.start, move.stop, self._block_size)
                meta.loads.append(move)
            extra = (req.sampling_params.extra_args if req.sampling_params is not None else None) or {}
            params = extra.get("kv_transfer_params") or {}
            if params.get("aaflow_save"):
                self._tracked[req.req_id] = _Tracked(params["aaflow_save"], list(req.prompt_token_ids or []),
                                                     block_ids, req.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is not None and cached.new_block_ids[i] is not None:
                t.block_ids.extend(cached.new_block_ids[i][0])
        for req_id, t in list(self._tracked.items()):
            t.num_computed += scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if t.num_computed >= len(t.prompt):
                n = len(t.prompt)
                meta.saves.append(KVMove(t.path, t.prompt, 0, n, _slots(t.block_ids, 0, n, self._block_size)))
                del self._tracked[req_id]
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        return False, None

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        named = []
        for name, cache in kv_caches.items():
            m = _LAYER_RE.search(name)
            if m is None:
                raise VLLMKVLayoutError(f"AAFlowConnector: cannot tell the layer index of KV cache {name!r}")
            named.append((int(m.group(1)), name, cache))
        named.sort()
        if [i for i, _, _ in named] != list(range(self._num_layers)):
            raise VLLMKVLayoutError(f"AAFlowConnector: expected one KV cache per layer 0..{self._num_layers - 1}, "
                                    f"got layers {[i for i, _, _ in named]}")
        want = (self._num_kv_heads, self._block_size, 2 * self._head_dim)
        for _, name, cache in named:  # generation still works; only KV save/load refuses
            if cache.device.type != "cpu" or cache.dim() != 4 or tuple(cache.shape[1:]) != want \
                    or not cache.is_contiguous():
                self._unsupported = (f"KV cache {name} is {tuple(cache.shape)} on {cache.device}; aaflow converts "
                                     f"only vLLM's CPU layout [blocks, {want[0]}, {want[1]}, {want[2]}]")
        self._layer_names = [n for _, n, _ in named]
        self._caches = [c for _, _, c in named]

    def _get_layout(self):
        if self._unsupported:
            raise VLLMKVLayoutError(f"AAFlowConnector cannot convert this KV layout: {self._unsupported}")
        if self._layout is None:
            layer = self._vllm_config.compilation_config.static_forward_context[self._layer_names[0]]
            isa = getattr(layer, "isa", None)
            if isa is None:
                raise VLLMKVLayoutError("AAFlowConnector: the attention backend is not vLLM's CPU backend "
                                        "(no ISA on the layer); only the CPU cache layout is supported")
            self._layout = CPUBlockLayout.learn(self._block_size, self._num_kv_heads, self._head_dim,
                                                self._caches[0].dtype, isa)
            logger.info("AAFlowConnector: learned CPU KV layout (isa %s)", isa)
        return self._layout

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for move in meta.loads:
            layout = self._get_layout()
            _, kv = read_kv_file(move.path)  # [L, 2, n, H, C]
            part = kv[:, :, move.start:move.stop]
            for i, cache in enumerate(self._caches):
                layout.scatter(cache, move.slots, part[i])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, after every layer has written its KV

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for move in meta.saves:
            layout = self._get_layout()
            kv = torch.stack([layout.gather(cache, move.slots) for cache in self._caches])  # [L, 2, n, H, C]
            write_kv_file(move.path, self._fingerprint, move.token_ids, kv)
