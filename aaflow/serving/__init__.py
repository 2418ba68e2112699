"""The OpenAI-compatible HTTP endpoint of a deployment: `aaflow serve --address ADDR`.

Clients written for vLLM, SGLang or OpenAI (the `openai` package, LangChain, LangGraph) point
their base URL at it; requests go to the deployment's one scheduling loop. Workflow hints
(`extra_body={"agent_hints": {"workflow_id", "agent_id", "reads", "ttl_s"}}`) let it treat the
requests of one workflow as one graph (`aaflow.serving.workflows`). `--api-key` (or
`AAFLOW_API_KEY`) asks every request but /health for a bearer key (`aaflow.serving.api_key`). Needs the `serve` extra
(`pip install aaflow[serve]`: FastAPI and uvicorn).

Layer: front end.
"""

from __future__ import annotations

import threading
import time

from aaflow.common.errors import AAFlowError
from aaflow.runtime import prompt_builders
from aaflow.serving.api_key import check_listen
from aaflow.cluster.deployment import connect

DEFAULT_HOST = "127.0.0.1"  # loopback unless told otherwise: nothing listens on every interface by default
DEFAULT_PORT = 8000


def serving_app(cluster, default_max_tokens: int | None = None, api_key: str | None = None,
                prefix_fetch: str = "auto"):
    """The FastAPI app for `cluster` (its models' tokenizers loaded here, to tokenize prompts and
    stream text); with `api_key`, every route but /health asks for it (`serving.api_key`);
    `prefix_fetch` is every run's (`af.start`)."""
    from aaflow.serving.app import DEFAULT_MAX_TOKENS, create_app  # optional: FastAPI (aaflow[serve])

    builders, _, _ = prompt_builders(set(cluster.models))
    return create_app(cluster, builders, default_max_tokens or DEFAULT_MAX_TOKENS, api_key, prefix_fetch)


def serve(address: str | None = None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          default_max_tokens: int | None = None, api_key: str | None = None, allow_no_key: bool = False,
          prefix_fetch: str = "auto") -> None:
    """Serve the deployment at `address` (or RAY_ADDRESS) over HTTP until interrupted. Without
    `api_key`, only on a loopback `host` unless `allow_no_key`. `prefix_fetch`: how a replica that
    lacks a request's shared prefix gets it (`af.start`'s): "auto" (the cost model), "move", "compute"."""
    check_listen(host, api_key, allow_no_key)
    try:
        import uvicorn  # optional: aaflow[serve]
    except ImportError as exc:
        raise AAFlowError("aaflow serve needs FastAPI and uvicorn: pip install 'aaflow[serve]'") from exc

    cluster = connect(address)
    try:
        print(f"aaflow serve: models {', '.join(sorted(cluster.models))} at http://{host}:{port}/v1 "
              f"(OpenAI-compatible; /metrics for Prometheus; "
              f"{'API key required' if api_key else 'no API key'})", flush=True)
        uvicorn.run(serving_app(cluster, default_max_tokens, api_key, prefix_fetch), host=host, port=port,
                    log_level="warning")
    finally:
        cluster.shutdown()


class BackgroundServer:
    """`app` served by uvicorn on a thread of this process (tests, benchmarks, notebooks):
    `url` is its base (`http://HOST:PORT`); `stop()` ends it."""

    def __init__(self, app, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, timeout_s: float = 60.0) -> None:
        import uvicorn  # optional: aaflow[serve]

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="aaflow-http")
        self.thread.start()
        deadline = time.time() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise AAFlowError(f"the HTTP server did not start on {host}:{port} (is the port taken?)")
            time.sleep(0.05)
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
