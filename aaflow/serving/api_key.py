"""The endpoint's API key: `aaflow serve --api-key KEY` (or `AAFLOW_API_KEY`).

With a key, every route but `/health` answers 401 unless the request carries
`Authorization: Bearer KEY` (what the `openai` client sends for its `api_key`); refusals are
counted in `/metrics` (`aaflow_auth_failures_total`). Without a key, `aaflow serve` listens only on
a loopback interface unless told `--allow-no-key`: anyone who can reach the port could run
workflows and read the deployment's metrics.
"""

from __future__ import annotations

import hmac
import ipaddress

from aaflow.common.errors import InvalidArgumentError

API_KEY_ENV = "AAFLOW_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # what a load balancer's health check reaches without the key


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_listen(host: str, api_key: str | None, allow_no_key: bool) -> None:
    """Refuse to serve without a key on an interface other machines can reach, unless allowed."""
    if api_key == "":
        raise InvalidArgumentError(f"the API key is empty: give a non-empty --api-key (or {API_KEY_ENV})")
    if api_key is None and not allow_no_key and not is_loopback(host):
        raise InvalidArgumentError(
            f"aaflow serve would listen on {host}, which other machines can reach, without an API key: give "
            f"--api-key KEY (or set {API_KEY_ENV}), or --allow-no-key to serve it open")


def require_key(app, api_key: str, refused) -> None:
    """Make `app` (FastAPI) answer 401 to every request but `OPEN_PATHS` that does not carry
    `Authorization: Bearer <api_key>`; `refused()` is called for each one refused."""
    from fastapi.responses import JSONResponse  # optional: aaflow[serve]

    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def authorize(request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return await call_next(request)
        refused()
        message = "a valid API key is needed: send 'Authorization: Bearer <key>'" if given else (
            "no API key: send 'Authorization: Bearer <key>' (the openai client's api_key)")
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": "invalid_api_key"}}, status_code=401)
