"""The endpoint's prompt tokens are vLLM's: a request's chat rendered by SmolLM2's chat template and
tokenized whole, exactly `apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`
(the tokenizer the issue measured, whose byte-level BPE tokenizes a blank line alone otherwise than
inside a text); `usage.prompt_tokens` counts them, and the answer over HTTP equals an `af.run` of
the same ids in fp32."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

import aaflow as af

SAMPLING = {"max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "seed": None, "ignore_eos": True}
USER = "  Paged attention keeps KV in blocks.\n\nPrefix caching reuses them.\n\n\nWhich is older?\n\nSay it.  \n"
SYSTEM = {"role": "system", "content": "You are terse.\n\nAnswer in one line."}
EARLIER = [{"role": "user", "content": "What is a KV cache?"}, {"role": "assistant", "content": "Attention state.\n\n"}]
CHATS = {"user only": [{"role": "user", "content": USER}],
         "with a system prompt": [SYSTEM, {"role": "user", "content": USER}],
         "with earlier turns": [SYSTEM, *EARLIER, {"role": "user", "content": USER}]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """What vLLM prefills for `messages` (transformers 5 returns a BatchEncoding here, 4 a list)."""
    got = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(got["input_ids"] if isinstance(got, Mapping) else got)


def _request_segments(tokenizer, messages: list[dict]):
    """The prompt segments of the agent the endpoint makes of a chat request with `messages`."""
    from aaflow.runtime.prompts import PromptBuilder
    from aaflow.serving.requests import Message, conversation
    from aaflow.serving.workflows import HintedWorkflows, request_run

    builder = PromptBuilder(tokenizer)
    system, history, user = conversation([Message(**m) for m in messages])
    run = request_run(builder, "smollm2", system, history, user, SAMPLING, None, HintedWorkflows(), "t")
    return builder, builder.segments(run.workflow, run.workflow.nodes[run.agent])


@pytest.mark.parametrize("case", list(CHATS))
def test_a_chat_request_prefills_the_chat_template_tokenized_whole(tokenizer, case):
    from aaflow.runtime.prompts import resolve

    messages = CHATS[case]
    builder, segments = _request_segments(tokenizer, messages)
    expected = _template_ids(tokenizer, messages)
    assert resolve(segments, {}) == expected, f"{case}: endpoint {resolve(segments, {})} != template {expected}"
    header = segments[0]  # the static prefix: the chat up to the user turn's start, never the whole prompt
    assert len(segments) == 2 and 0 < len(header) < len(expected)
    assert tokenizer.decode(header).rstrip("\n").endswith("<|im_start|>user"), tokenizer.decode(header)
    paragraphs = af.Workflow("paragraphs")  # what the endpoint prefilled before: the user text split at blank lines
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    ref = paragraphs.agent("a", "smollm2", USER.split("\n\n"), system=system,
                           history=[m for m in messages[:-1] if m["role"] != "system"])
    old = resolve(builder.segments(paragraphs, paragraphs.nodes[ref.name]), {})
    assert len(old) != len(expected)  # the checks here, of ids and of usage.prompt_tokens, can tell the two apart


@pytest.fixture(scope="module")
def served(smollm2_dir):
    from aaflow.serving import BackgroundServer, serving_app
    from aaflow.benchmarks.ray_head import free_ports

    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    model = str(smollm2_dir)
    cluster = af.init(replicas={model: 1}, dtype="float32")
    server = BackgroundServer(serving_app(cluster), port=free_ports(1)[0])
    yield cluster, model, openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()
    cluster.shutdown()


def test_over_http_usage_counts_the_whole_tokenized_chat_and_the_answer_is_af_runs(served, tokenizer):
    cluster, model, client = served
    messages = CHATS["with earlier turns"]
    expected = _template_ids(tokenizer, messages)
    got = client.chat.completions.create(model=model, messages=messages, max_tokens=SAMPLING["max_tokens"],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == len(expected)
    _, segments = _request_segments(tokenizer, messages)
    header = len(segments[0])  # split where the endpoint splits: the same prefill, so the same fp32 answer
    wf = af.Workflow("direct")
    prompt = [wf.context("header", token_ids=expected[:header]), wf.context("turn", token_ids=expected[header:])]
    wf.agent("answer", model, prompt, rendered=True, max_tokens=SAMPLING["max_tokens"], ignore_eos=True)
    direct = af.run(wf, cluster, strategy="text")["answer"]
    assert direct.prompt_tokens == len(expected)
    assert got.choices[0].message.content == direct.text
    completion = client.completions.create(model=model, prompt=USER, max_tokens=1, temperature=0)
    assert completion.usage.prompt_tokens == len(_template_ids(tokenizer, [{"role": "user", "content": USER}]))
