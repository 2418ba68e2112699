"""The vLLM side of `VLLMEngine`: one vLLM `LLMEngine` in this process, driven over a local socket.

Run by `VLLMEngine` as `<vllm python> -m aaflow.engines_vllm.server CONFIG_JSON` with
AAFLOW_VLLM_FD naming its end of a socket pair (inherited; nothing listens anywhere). It starts
vLLM with the aaflow KV connector registered, sends {"ok": True, "info": ...} or {"ok": False, ...} when startup fails, then answers requests
(plain dicts, see `handle`) until "shutdown" or EOF. Only stdlib, torch and vLLM are imported
here: this runs in vLLM's environment, not aaflow's.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path


def start_llm(cfg: dict):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kv_cache_gib"]))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler + worker here: the registry below is seen
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from aaflow.engines_vllm.connector import CONNECTOR_NAME

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "aaflow.engines_vllm.connector", "AAFlowConnector")
    kv_config = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both",
                                 kv_connector_extra_config={"fingerprint": cfg["fingerprint"]})
    kwargs = dict(model=cfg["model_path"], dtype=cfg["dtype"], enforce_eager=cfg["enforce_eager"],
                  enable_prefix_caching=cfg["prefix_caching"], max_model_len=cfg["max_model_len"],
                  seed=0, kv_transfer_config=kv_config, disable_hybrid_kv_cache_manager=True)
    if cfg.get("block_size"):
        kwargs["block_size"] = cfg["block_size"]
    return LLM(**kwargs)


def run_requests(llm, requests: list[dict]) -> list[dict]:
    """Each request: prompt_token_ids, max_tokens, temperature, top_p, seed, stop_token_ids,
    ignore_eos, load (KV file or None), save (KV file or None). Returns one dict per request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    start = time.perf_counter()
    ids, results = [], {}
    for i, r in enumerate(requests):
        kv_params = {k: v for k, v in (("aaflow_load", r.get("load")), ("aaflow_save", r.get("save"))) if v}
        sp = SamplingParams(temperature=r["temperature"], top_p=r["top_p"], seed=r["seed"],
                            max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                            stop_token_ids=r["stop_token_ids"], detokenize=False,
                            extra_args={"kv_transfer_params": kv_params} if kv_params else None)
        rid = f"aaflow-{time.monotonic_ns()}-{i}"
        ids.append(rid)
        results[rid] = {"first_s": None}
        engine.add_request(rid, TokensPrompt(prompt_token_ids=r["prompt_token_ids"]), sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            res = results[out.request_id]
            if res["first_s"] is None and out.outputs and out.outputs[0].token_ids:
                res["first_s"] = time.perf_counter() - start
            if out.finished:
                o = out.outputs[0]
                res.update(token_ids=list(o.token_ids), finish_reason=o.finish_reason,
                           stop_reason=o.stop_reason, num_cached_tokens=out.num_cached_tokens or 0,
                           total_s=time.perf_counter() - start)
    for rid, r in zip(ids, requests):
        refused = Path(f"{r['load']}.refused") if r.get("load") else None
        results[rid]["refused"] = refused.read_text() if refused is not None and refused.exists() else None
    return [results[rid] for rid in ids]


def info(llm, cfg: dict) -> dict:
    import torch
    import vllm

    vc = llm.llm_engine.vllm_config
    return {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "block_size": vc.cache_config.block_size, "device": str(vc.device_config.device),
            "prefix_caching": vc.cache_config.enable_prefix_caching, "pid": os.getpid(),
            "max_model_len": vc.model_config.max_model_len}


def handle(llm, cfg: dict, msg: dict) -> dict:
    if msg["op"] == "generate":
        return {"ok": True, "outputs": run_requests(llm, msg["requests"])}
    if msg["op"] == "info":
        return {"ok": True, "info": info(llm, cfg)}
    if msg["op"] == "reset_prefix_cache":
        return {"ok": True, "done": bool(llm.reset_prefix_cache())}
    return {"ok": False, "error": "ValueError", "message": f"unknown op {msg['op']!r}"}


def _error(exc: BaseException) -> dict:
    return {"ok": False, "error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    conn = Connection(int(os.environ.pop("AAFLOW_VLLM_FD")))
    try:
        t0 = time.perf_counter()
        llm = start_llm(cfg)
        conn.send({"ok": True, "info": {**info(llm, cfg), "startup_s": time.perf_counter() - t0}})
    except BaseException as exc:  # noqa: BLE001 - reported to the client, which raises a typed error
        conn.send(_error(exc))
        return 1
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return 0
        if msg.get("op") == "shutdown":
            conn.send({"ok": True})
            return 0
        try:
            conn.send(handle(llm, cfg, msg))
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the replica
            conn.send(_error(exc))


if __name__ == "__main__":
    sys.exit(main())
