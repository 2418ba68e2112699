"""`aaflow serve --api-key`: the official `openai` client over real HTTP (uvicorn on loopback)
against a local cluster of the tiny model; every route but /health asks for the key, refusals are
counted in /metrics, and serving open on a reachable interface is refused unless allowed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

import aaflow as af

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

KEY = "test-key-7f3a"


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    from aaflow.serving import BackgroundServer, serving_app
    from aaflow.benchmarks.ray_head import free_ports

    cluster = af.init(replicas={str(tiny_llama_dir): 1}, dtype="float32")
    server = BackgroundServer(serving_app(cluster, api_key=KEY), port=free_ports(1)[0])
    yield str(tiny_llama_dir), server.url
    server.stop()
    cluster.shutdown()


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_key_opens_every_route_and_a_wrong_or_missing_key_is_refused_and_counted(served):
    model, url = served
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    answer = good.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there."}],
                                          max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 4
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello."}], max_tokens=4)
    assert refused.value.status_code == 401 and "API key" in refused.value.message
    assert KEY not in refused.value.message
    status, body = _get(f"{url}/v1/models")  # no key at all
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert _get(f"{url}/metrics")[0] == 401
    assert _get(f"{url}/health") == (200, b'{"status":"ok"}')  # a health check needs no key
    status, metrics = _get(f"{url}/metrics", KEY)
    assert status == 200
    assert "aaflow_auth_failures_total 3.0" in metrics.decode()  # the wrong key, /v1/models, /metrics
    assert "aaflow_requests_total 1.0" in metrics.decode()


@pytest.mark.parametrize("host, key, allowed", [("0.0.0.0", None, False), ("10.1.2.3", None, False),
                                                ("example.internal", None, False), ("127.0.0.1", None, True),
                                                ("::1", None, True), ("localhost", None, True),
                                                ("0.0.0.0", KEY, True), ("127.0.0.1", "", False)])
def test_serving_without_a_key_is_refused_where_other_machines_can_reach_it(host, key, allowed):
    from aaflow.serving.api_key import check_listen

    if allowed:
        check_listen(host, key, allow_no_key=False)
        return
    with pytest.raises(af.InvalidArgumentError, match="--api-key|empty"):
        check_listen(host, key, allow_no_key=False)
    if key is None:
        check_listen(host, None, allow_no_key=True)  # told to serve it open


def test_the_cli_refuses_before_it_connects_and_names_the_fix(capsys, monkeypatch):
    from aaflow.cli import main

    monkeypatch.delenv("AAFLOW_API_KEY", raising=False)
    code = main(["serve", "--address", "127.0.0.1:1", "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert code != 0 and "--api-key" in err and "--allow-no-key" in err and "Traceback" not in err
