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

import torch


def start_llm(cfg: dict):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kv_cache_gib"]))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler + worker here: the registry below is seen
    from vllm import LLM  # optional: vLLM (this process runs in its venv)
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from aaflow.engines_vllm.connector import CONNECTOR_NAME  # optional: imports vLLM

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


class Driver:
    """vLLM's `LLMEngine` stepped on demand, with every request's new tokens buffered.

    One-shot batches (`run`) and long-lived session requests (`add` / `next_tokens` / `abort`)
    share the engine: stepping for one request advances every running request, so tokens of the
    others are kept until asked for. A request dict: prompt_token_ids, max_tokens, temperature,
    top_p, seed, stop_token_ids, ignore_eos, load / save (KV file or None), no_cache (skip reading
    the prefix cache).
    """

    def __init__(self, llm) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.reqs: dict[str, dict] = {}

    def add(self, rid: str, r: dict) -> None:
        from vllm import SamplingParams  # optional: vLLM (this process runs in its venv)
        from vllm.inputs import TokensPrompt

        if rid in self.reqs:
            raise ValueError(f"request id {rid!r} is already running")
        kv_params = {k: v for k, v in (("aaflow_load", r.get("load")), ("aaflow_save", r.get("save"))) if v}
        sp = SamplingParams(temperature=r["temperature"], top_p=r["top_p"], seed=r["seed"],
                            max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                            stop_token_ids=r["stop_token_ids"], detokenize=False,
                            skip_reading_prefix_cache=bool(r.get("no_cache")) or None,
                            extra_args={"kv_transfer_params": kv_params} if kv_params else None)
        self.reqs[rid] = {"start": time.perf_counter(), "first_s": None, "token_ids": [], "taken": 0,
                          "finished": False, "finish_reason": None, "stop_reason": None,
                          "num_cached_tokens": None, "load": r.get("load")}
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=r["prompt_token_ids"]), sp)

    def step(self) -> None:
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("vLLM has no unfinished request to step, yet a request waits for tokens")
        for out in self.engine.step():
            st = self.reqs.get(out.request_id)
            if st is None:
                continue
            o = out.outputs[0] if out.outputs else None
            if o is not None and o.token_ids:
                st["token_ids"] = list(o.token_ids)
                if st["first_s"] is None:
                    st["first_s"] = time.perf_counter() - st["start"]
            if out.num_cached_tokens is not None:
                st["num_cached_tokens"] = out.num_cached_tokens
            if out.finished:
                st.update(finished=True, finish_reason=o.finish_reason if o else None,
                          stop_reason=o.stop_reason if o else None, total_s=time.perf_counter() - st["start"])

    def _result(self, rid: str) -> dict:
        st = self.reqs[rid]
        refused = Path(f"{st['load']}.refused") if st["load"] else None
        return {"token_ids": list(st["token_ids"]), "finish_reason": st["finish_reason"],
                "stop_reason": st["stop_reason"], "num_cached_tokens": st["num_cached_tokens"] or 0,
                "first_s": st["first_s"], "total_s": st.get("total_s", time.perf_counter() - st["start"]),
                "refused": refused.read_text() if refused is not None and refused.exists() else None}

    def run(self, requests: list[dict]) -> list[dict]:
        """Run a batch to completion (other running requests advance too; their tokens are kept)."""
        ids = [f"aaflow-{time.monotonic_ns()}-{i}" for i in range(len(requests))]
        try:
            for rid, r in zip(ids, requests):
                self.add(rid, r)
            while not all(self.reqs[rid]["finished"] for rid in ids):
                self.step()
            return [self._result(rid) for rid in ids]
        finally:
            for rid in ids:
                self.abort(rid)

    def next_tokens(self, rids: list[str]) -> list[dict]:
        """Each request's next token not yet handed out ({"token", "num_cached_tokens", "refused",
        "finished"}), stepping the engine until every one of them has one."""
        for rid in rids:
            if rid not in self.reqs:
                raise KeyError(f"no running request {rid!r}")

        def waiting() -> list[str]:
            return [r for r in rids if self.reqs[r]["taken"] >= len(self.reqs[r]["token_ids"])]

        while waiting():
            done = [r for r in waiting() if self.reqs[r]["finished"]]
            if done:
                raise RuntimeError(f"request(s) {done} finished (max_tokens or a stop token) and have no more tokens")
            self.step()
        outs = []
        for rid in rids:
            st = self.reqs[rid]
            res = self._result(rid)
            outs.append({"token": st["token_ids"][st["taken"]], "num_cached_tokens": res["num_cached_tokens"],
                         "refused": res["refused"], "first_s": st["first_s"],
                         "finished": st["finished"] and st["taken"] + 1 == len(st["token_ids"])})
            st["taken"] += 1
        return outs

    def abort(self, rid: str) -> None:
        st = self.reqs.pop(rid, None)
        if st is not None and not st["finished"]:
            self.engine.abort_request([rid])

    def used_blocks(self) -> int | None:
        """KV blocks held by running requests (cached free blocks not counted); None if unknown."""
        try:
            pool = self.engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
            if not hasattr(self, "_idle_free"):
                self._idle_free = pool.get_num_free_blocks() if not self.reqs else None
            if self._idle_free is None:
                return None
            return self._idle_free - pool.get_num_free_blocks()
        except AttributeError:
            return None


def info(llm, cfg: dict) -> dict:
    import vllm  # optional: vLLM (this process runs in its venv)

    vc = llm.llm_engine.vllm_config
    return {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "block_size": vc.cache_config.block_size, "device": str(vc.device_config.device),
            "prefix_caching": vc.cache_config.enable_prefix_caching, "pid": os.getpid(),
            "max_model_len": vc.model_config.max_model_len}


def handle(driver: Driver, cfg: dict, msg: dict) -> dict:
    op = msg["op"]
    if op == "generate":
        return {"ok": True, "outputs": driver.run(msg["requests"])}
    if op == "add":
        driver.add(msg["rid"], msg["request"])
        return {"ok": True}
    if op == "next_tokens":
        return {"ok": True, "outputs": driver.next_tokens(msg["rids"])}
    if op == "abort":
        for rid in msg["rids"]:
            driver.abort(rid)
        return {"ok": True}
    if op == "stats":
        return {"ok": True, "stats": {"running": len(driver.reqs), "used_blocks": driver.used_blocks()}}
    if op == "info":
        return {"ok": True, "info": info(driver.llm, cfg)}
    if op == "reset_prefix_cache":
        return {"ok": True, "done": bool(driver.llm.reset_prefix_cache())}
    return {"ok": False, "error": "ValueError", "message": f"unknown op {op!r}"}


def _error(exc: BaseException) -> dict:
    return {"ok": False, "error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    conn = Connection(int(os.environ.pop("AAFLOW_VLLM_FD")))
    try:
        t0 = time.perf_counter()
        llm = start_llm(cfg)
        driver = Driver(llm)
        driver.used_blocks()  # the idle baseline
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
            conn.send(handle(driver, cfg, msg))
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the replica
            conn.send(_error(exc))


if __name__ == "__main__":
    sys.exit(main())
