"""The OpenAI-compatible HTTP API of a deployment (FastAPI; `aaflow serve` runs it on uvicorn).

`/v1/chat/completions` and `/v1/completions` (streaming as server-sent events, or not),
`/v1/models`, `/metrics` (Prometheus) and `/health`. Every request becomes a run on the
deployment's one scheduling loop (`aaflow.serving.workflows`), so requests from every client are
batched together; a client that disconnects mid-stream cancels its run, which frees its KV.
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens served from KV already
there (prefix cache, a shared prefix forked or moved), as vLLM reports them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

import aaflow as af
from aaflow.serving.api_key import require_key
from aaflow.serving.detokenize import IncrementalText
from aaflow.serving.metrics import ServingMetrics
from aaflow.serving.requests import ChatRequest, CompletionRequest, RequestError, conversation, sampling_options
from aaflow.serving.workflows import HintedWorkflows, RequestRun, request_run

DEFAULT_MAX_TOKENS = 256


def create_app(cluster, builders: dict, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               api_key: str | None = None, prefix_fetch: str = "auto") -> FastAPI:
    """The API for `cluster` (a deployment from `af.connect`, or a local `af.init` cluster);
    `builders` the `PromptBuilder` per served model name (to tokenize prompts, and to stream text
    as tokens arrive). With `api_key`, every route but /health asks for it (`serving.api_key`).
    `prefix_fetch` is every run's (`af.start`: how a replica gets a shared prefix it lacks)."""
    app = FastAPI(title="aaflow", description="OpenAI-compatible API of an aaflow deployment")
    hinted, metrics, created = HintedWorkflows(), ServingMetrics(), int(time.time())
    if api_key is not None:
        require_key(app, api_key, metrics.auth_failures.inc)

    @app.exception_handler(RequestError)
    async def refused(_: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where)

    @app.exception_handler(af.AAFlowError)
    async def failed(_: Request, exc: af.AAFlowError) -> JSONResponse:
        if isinstance(exc, (af.WorkflowError, af.PromptError, af.SamplingError, af.InvalidArgumentError)):
            return _error(400, f"{type(exc).__name__}: {exc}", None)  # the request asked for what cannot be
        return _error(500, f"{type(exc).__name__}: {exc}", None, "server_error")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "aaflow"}
                                           for m in cluster.models]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=metrics.content_type)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        body.refuse_unsupported()
        system, history, user = conversation(body.messages)
        return await _serve(body, system, history, user, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        body.refuse_unsupported()
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1 or not prompts[0]:
            raise RequestError("prompt must be one non-empty string", "prompt")
        return await _serve(body, None, [], prompts[0], chat=False)

    async def _serve(body, system, history, user: str, chat: bool):
        if body.model not in cluster.models:
            raise RequestError(f"model {body.model!r} is not served here; GET /v1/models lists "
                               f"{sorted(cluster.models)}", "model", status=404)
        request_id = uuid.uuid4().hex[:16]
        run = await run_in_threadpool(request_run, builders[body.model], body.model, system, history, user,
                                      sampling_options(body, default_max_tokens), body.agent_hints, hinted, request_id)
        reply = _Reply(request_id, body.model, chat, created=int(time.time()))
        began = time.perf_counter()
        loop, tokens = asyncio.get_running_loop(), asyncio.Queue()
        on_token = (lambda _, t: loop.call_soon_threadsafe(tokens.put_nowait, t)) if body.stream else None
        # started here, streaming or not: a run refused at its start is an HTTP error, not a broken stream
        handle = await run_in_threadpool(lambda: af.start(run.workflow, cluster, strategy=run.strategy,
                                                          on_token=on_token, prefix_fetch=prefix_fetch,
                                                          **run.options))
        if body.stream:
            return StreamingResponse(_stream(run, body, handle, tokens, reply, began), media_type="text/event-stream")
        answer = (await _ended(handle)).agents[run.agent]
        metrics.finished(answer, time.perf_counter() - began)
        return reply.whole(answer, run.max_tokens)

    async def _stream(run: RequestRun, body, handle, tokens: asyncio.Queue, reply: "_Reply", began: float):
        text = IncrementalText(builders[body.model].tokenizer)
        waiting = asyncio.ensure_future(_ended(handle))
        first = None
        try:
            yield reply.chunk(role=True)
            while True:
                getting = asyncio.ensure_future(tokens.get())
                done, _ = await asyncio.wait({getting, waiting}, return_when=asyncio.FIRST_COMPLETED)
                if getting not in done:
                    getting.cancel()
                    break
                first = first or time.perf_counter() - began
                piece = text.add(getting.result())
                if piece:
                    yield reply.chunk(piece)
            while not tokens.empty():
                piece = text.add(tokens.get_nowait())
                if piece:
                    yield reply.chunk(piece)
            answer = (await waiting).agents[run.agent]
            rest = text.rest()
            if rest:
                yield reply.chunk(rest)
            metrics.finished(answer, time.perf_counter() - began, first)
            yield reply.chunk(finish=_finish_reason(answer, run.max_tokens))
            if body.include_usage:
                yield reply.usage_chunk(answer)
            yield "data: [DONE]\n\n"
        except af.AAFlowError as exc:
            yield f"data: {json.dumps({'error': {'message': f'{type(exc).__name__}: {exc}', 'type': 'server_error'}})}\n\n"
        finally:
            if not handle.done():  # the client went away: its run ends, its KV is freed
                handle.cancel()
                metrics.cancelled()

    return app


async def _ended(handle):
    """The run's `RunResult`, awaited without holding a thread (its error raised)."""
    loop, done = asyncio.get_running_loop(), asyncio.Event()
    handle.add_done_callback(lambda _: loop.call_soon_threadsafe(done.set))
    await done.wait()
    return handle.result(timeout=0)


def _finish_reason(answer, max_tokens: int) -> str:
    """"stop" when it decoded its end-of-sequence token (not in its text), "length" at max_tokens."""
    ended = answer.decoded > len(answer.token_ids)
    return "length" if not ended and answer.decoded >= max_tokens else "stop"


def _usage(answer) -> dict:
    completion = len(answer.token_ids)
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": completion,
            "total_tokens": answer.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": answer.prefill_reused}}


def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


class _Reply:
    """The response bodies of one request, chat or completions."""

    def __init__(self, request_id: str, model: str, chat: bool, created: int) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model, self.chat, self.created = model, chat, created

    def _body(self, choice: dict, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def whole(self, answer, max_tokens: int) -> dict:
        finish = _finish_reason(answer, max_tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": answer.text}, "finish_reason": finish}
                  if self.chat else {"index": 0, "text": answer.text, "finish_reason": finish, "logprobs": None})
        return {**self._body(choice, chunk=False), "usage": _usage(answer)}

    def chunk(self, text: str = "", role: bool = False, finish: str | None = None) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps(self._body(choice, chunk=True))}\n\n"

    def usage_chunk(self, answer) -> str:
        body = {**self._body({}, chunk=True), "choices": [], "usage": _usage(answer)}
        return f"data: {json.dumps(body)}\n\n"
