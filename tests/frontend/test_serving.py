"""The OpenAI-compatible endpoint (aaflow/serving), driven by the official `openai` client over
real HTTP (uvicorn on loopback) against a local cluster of the tiny model: answers equal to the
same agent run through `af.run`, streaming, usage with cached tokens, errors, metrics, and
workflow hints."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

import aaflow as af

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

DOC = ("Paged attention stores the KV cache in fixed-size blocks, so sequences share blocks copy-on-write "
       "and a prefix computed once serves every later request that starts with it.")  # the tiny model has 512 positions
SYSTEM = "You are a careful reviewer."


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    from aaflow.serving import BackgroundServer, serving_app
    from aaflow.benchmarks.ray_head import free_ports

    model = str(tiny_llama_dir)
    cluster = af.init(replicas={model: 2}, dtype="float32")
    server = BackgroundServer(serving_app(cluster), port=free_ports(1)[0])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    yield cluster, model, client, server.url
    server.stop()
    cluster.shutdown()


def _alone(cluster, model: str, prompt, system=SYSTEM, history=(), tokens: int = 12) -> af.RunResult:
    wf = af.Workflow("alone")
    wf.agent("answer", model, prompt, system=system, history=list(history), max_tokens=tokens, ignore_eos=True)
    return af.run(wf, cluster, strategy="text")["answer"]


def _chat(client, model: str, user: str, system=SYSTEM, tokens: int = 12, **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0,
                                          extra_body={"ignore_eos": True, **extra.pop("extra_body", {})}, **extra)


def test_chat_answers_as_af_run_does_and_reports_cached_tokens(served):
    cluster, model, client, _ = served
    expected = _alone(cluster, model, ["Summarize: " + DOC])
    first = _chat(client, model, "Summarize: " + DOC)
    assert first.choices[0].message.content == expected.text
    assert first.choices[0].finish_reason == "length" and first.object == "chat.completion"
    assert first.usage.prompt_tokens == expected.prompt_tokens and first.usage.completion_tokens == 12
    again = _chat(client, model, "Summarize: " + DOC)  # the same prompt: the prefix cache serves its blocks
    assert again.choices[0].message.content == expected.text
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_a_conversation_with_earlier_turns_renders_as_the_chat_template_does(served):
    cluster, model, client, _ = served
    history = [{"role": "user", "content": "What is a KV cache?"}, {"role": "assistant", "content": "Attention state."}]
    expected = _alone(cluster, model, ["And paged attention?"], history=history)
    messages = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": "And paged attention?"}]
    got = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == expected.prompt_tokens


def test_streaming_gives_the_same_text_then_usage(served):
    cluster, model, client, _ = served
    whole = _chat(client, model, "Stream this: " + DOC[:200]).choices[0].message.content
    chunks = list(_chat(client, model, "Stream this: " + DOC[:200], stream=True,
                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_completions_and_models(served):
    cluster, model, client, _ = served
    expected = _alone(cluster, model, ["Once upon a time"], system=None)
    got = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.text
    streamed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    assert [m.id for m in client.models.list().data] == [model]


def test_bad_requests_get_openai_errors_naming_the_field(served):
    _, model, client, _ = served
    with pytest.raises(openai.NotFoundError, match="not served here"):
        _chat(client, "no-such-model", "hi")
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        _chat(client, model, "hi", n=2)
    with pytest.raises(openai.BadRequestError, match="last message must have role 'user'"):
        client.chat.completions.create(model=model, messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        _chat(client, model, "hi", tokens=0)
    with pytest.raises(openai.BadRequestError, match="ttl_s"):
        _chat(client, model, "hi", extra_body={"agent_hints": {"workflow_id": "w", "ttl_s": -1}})


def test_metrics_count_requests_and_tokens(served):
    _, model, client, url = served
    _chat(client, model, "Count me.")
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    assert "aaflow_requests_total" in text and "aaflow_cached_prompt_tokens_total" in text
    requests = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("aaflow_requests_total")))
    assert requests >= 1


def _fan_out(client, model: str, doc: str, hints: bool) -> list:
    """A 1 -> 6 fan-out as 7 chat requests: a planner over the document, then six readers of the
    document and its answer, sent at once. The seven replies."""
    def hint(agent: str, reads=()) -> dict:
        return {"agent_hints": {"workflow_id": doc[:12], "agent_id": agent, "reads": list(reads), "ttl_s": 2,
                                "priority": "ignored"}} if hints else {}

    plan = _chat(client, model, f"{doc}\n\nPlan six questions about this document.", extra_body=hint("plan"))
    replies: list = [None] * 6

    def reader(i: int) -> None:
        replies[i] = _chat(client, model, f"{doc}\n\nThe plan: {plan.choices[0].message.content}\n\n"
                                          f"Answer question {i + 1}.", extra_body=hint(f"q{i}", ["plan"]))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [plan, *replies]


def test_with_workflow_hints_every_reader_forks_the_document(served):
    """With hints, the token prefix the readers share with the workflow's first request (the chat
    header and the document) is a context the scheduler materializes once per replica at most and
    forks for each reader: every reader's prompt has the document from KV already there
    (cached_tokens). Unknown hint fields are ignored."""
    cluster, model, client, _ = served
    doc = "Workflow hints, run 1. " + DOC
    replies = _fan_out(client, model, doc, hints=True)
    assert all(r.choices[0].message.content for r in replies)
    def prompt_tokens(user: str) -> int:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": user}],
                                              max_tokens=1).usage.prompt_tokens

    lead = prompt_tokens(doc) - prompt_tokens("x")  # the document's tokens
    assert all(r.usage.prompt_tokens_details.cached_tokens >= lead for r in replies[1:]), \
        [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    import ray

    held = lambda: sum(ray.get(r.actor.stats.remote())["refs"] for r in cluster.replicas())  # noqa: E731
    assert held() >= 1  # kept for ttl_s after the readers ended
    deadline = time.time() + 20
    while held() and time.time() < deadline:
        time.sleep(0.2)
    assert held() == 0, "the document was kept past its ttl_s"


def test_a_request_becomes_one_rendered_agent_and_hints_share_the_common_token_prefix(tiny_llama_dir):
    """A request's agent reads its whole tokenized chat as two token-id contexts: the chat header
    (its static prefix), then the rest. With hints, a later request of the workflow shares the
    token prefix it has in common with the first (the reference, cut to what was shared); a request
    sharing less than a block beyond the header shares nothing; a request of another workflow, or
    without hints, that begins with a prefix shared before shares it (of the same model only)."""
    from transformers import AutoTokenizer

    from aaflow.runtime.prompts import PromptBuilder
    from aaflow.serving.requests import AgentHintsBody, Message, conversation
    from aaflow.serving.known_prefixes import KEEP_KNOWN_S
    from aaflow.serving.workflows import MIN_SHARED_TOKENS, HintedWorkflows, request_run

    system, history, user = conversation([Message(role="system", content="S"), Message(role="user", content="u1"),
                                          Message(role="assistant", content=[{"type": "text", "text": "a1"}]),
                                          Message(role="user", content="u2")])
    assert (system, history, user) == ("S", [("user", "u1"), ("assistant", "a1")], "u2")
    builder = PromptBuilder(AutoTokenizer.from_pretrained(str(tiny_llama_dir)))  # one token per byte
    sampling = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": None, "ignore_eos": False}
    remembered = HintedWorkflows()

    def run(user: str, hints=None, request_id: str = "r"):
        got = request_run(builder, "m", None, [], user, sampling, hints, remembered, request_id)
        node = got.workflow.nodes[got.agent]
        assert node.rendered and node.system is None
        return got, builder.segments(got.workflow, node)

    header = len(builder.frame(None)[0])
    plain, segments = run("Doc.\n\nQuestion?")
    ids, _ = builder.chat(None, (), "Doc.\n\nQuestion?")
    assert plain.strategy == "text" and segments == [ids[:header], ids[header:]]
    doc = "A shared document of some length.\n\nPlan"
    hints = AgentHintsBody(workflow_id="w", agent_id="a", ttl_s=9)
    first, segments = run(doc + ". Six questions.", hints)
    assert first.strategy == "text" and first.options == {"keep_prefix_s": 9} and len(segments[0]) == header
    reader_hints = hints.model_copy(update={"agent_id": "b"})
    reader, segments = run(doc + ": x\n\nQ1?", reader_hints)
    ids, _ = builder.chat(None, (), doc + ": x\n\nQ1?")
    shared = header + len(doc)  # the first differs at ". Six" against ": x"
    assert shared - header >= MIN_SHARED_TOKENS
    assert reader.agent == "b" and segments == [ids[:shared], ids[shared:]]
    assert reader.strategy == "auto" and reader.options["plan"].decisions == {"b": "transfer"}  # the cost model's to move
    assert reader.options["keep_prefix_s"] == 9  # its workflow's ttl_s; nothing else keeps what a workflow shares
    again, segments = run(doc + ". Six more questions.", reader_hints)  # shares more with the first request,
    assert again.strategy == "auto" and segments[0] == ids[:shared]  # but the workflow's prefix stays one
    short, segments = run("Another document.\n\nQ2?", reader_hints)
    assert short.strategy == "text" and len(segments[0]) == header
    other, segments = run(doc + ": y\n\nQ9?", AgentHintsBody(workflow_id="w2"))  # another workflow's first request
    assert other.strategy == "auto" and len(segments[0]) == shared  # begins with the prefix w shared: forks it
    assert other.options["keep_prefix_s"] == KEEP_KNOWN_S  # read across workflows: kept for the next reader
    unhinted, segments = run(doc + " and more.\n\nQ3?")
    assert unhinted.strategy == "auto" and len(segments[0]) == shared
    assert unhinted.options["keep_prefix_s"] == KEEP_KNOWN_S
    unshared, segments = run(doc[:-2] + "\n\nQ4?")  # stops short of the prefix shared
    assert unshared.strategy == "text" and len(segments[0]) == header
    got = request_run(builder, "other-model", None, [], doc + ": x\n\nQ1?", sampling, None, remembered, "m")
    assert got.strategy == "text"  # a prefix is shared only between requests of one model
    with pytest.raises(af.WorkflowError):
        af.Workflow("x").agent("a", "m", ["hi"], history=[{"role": "tool", "content": "x"}])


def test_serve_passes_its_prefix_fetch_to_every_run_and_refuses_an_unknown_one(capsys, monkeypatch):
    import aaflow.cli_deploy as cli_deploy
    from aaflow.cli import main

    seen = {}
    monkeypatch.setattr(cli_deploy, "serve", lambda address, **kwargs: seen.update(kwargs))
    assert main(["serve", "--address", "127.0.0.1:1", "--prefix-fetch", "compute"]) == 0
    assert seen["prefix_fetch"] == "compute"
    assert main(["serve", "--address", "127.0.0.1:1"]) == 0 and seen["prefix_fetch"] == "auto"
    with pytest.raises(SystemExit):
        main(["serve", "--prefix-fetch", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
