"""Workflow DSL and YAML validation: every bad input is a `WorkflowError` naming the node or key."""

from __future__ import annotations

import pytest

import aaflow as af
from aaflow.workflow_files import workflow_from_dict


def review_workflow():
    wf = af.Workflow("review")
    doc = wf.context("paper", "A paper about KV caches.")
    revs = [wf.agent(f"r{i}", model="smollm2", prompt=[doc, f"Review the {x}."]) for i, x in
            enumerate(["method", "results", "writing"])]
    wf.agent("meta", model="smollm2", prompt=[doc, *revs, "Summarize the reviews."], max_tokens=64)
    return wf


def test_topological_order_puts_inputs_first():
    order = review_workflow().topological_order()
    assert order.index("paper") < order.index("r0") < order.index("meta")
    assert order.index("r2") < order.index("meta")


def test_python_dsl_errors_name_the_node():
    wf = af.Workflow("w")
    doc = wf.context("doc", "text")
    with pytest.raises(af.WorkflowError, match="'doc' is defined twice"):
        wf.context("doc", "again")
    with pytest.raises(af.WorkflowError, match="agent 'a': the prompt is empty"):
        wf.agent("a", "smollm2", [])
    with pytest.raises(af.WorkflowError, match="agent 'a': max_tokens"):
        wf.agent("a", "smollm2", [doc], max_tokens=0)
    with pytest.raises(af.WorkflowError, match="unknown strategy 'fast'"):
        wf.agent("a", "smollm2", [doc], strategy="fast")
    with pytest.raises(af.WorkflowError, match="'a' refers to unknown node 'ghost'"):
        wf.agent("a", "smollm2", [af.workflow.Ref("ghost", "agent")])
    with pytest.raises(af.WorkflowError, match="prompt part must be a string"):
        wf.agent("a", "smollm2", [42])
    with pytest.raises(af.WorkflowError, match="unknown operator 'teleport'"):
        wf.kv_op("k", "teleport", doc)


def test_token_id_contexts_and_rendered_agents_are_checked():
    wf = af.Workflow("w")
    ids = wf.context("ids", token_ids=[1, 2])
    for kwargs, match in (({"text": "t", "token_ids": [1]}, "give text or token_ids, not both"),
                          ({"token_ids": []}, "token_ids must be a non-empty list of ints"),
                          ({"token_ids": [1, -1]}, "token ids must be ints >= 0, got -1"),
                          ({"token_ids": [1, True]}, "token ids must be ints >= 0, got True")):
        with pytest.raises(af.WorkflowError, match=f"context 'c': {match}"):
            wf.context("c", **kwargs)
    for prompt, kwargs, match in (([ids, "x"], {"system": "S"}, "give no system or history"),
                                  (["x", ids], {}, "must start with a context"),
                                  ([ids], {}, "and have another part after it"),
                                  ([ids, "x"], {"rendered": "yes"}, "rendered must be true or false")):
        with pytest.raises(af.WorkflowError, match=f"agent 'a': .*{match}"):
            wf.agent("a", "m", prompt, **{"rendered": True, **kwargs})


def test_a_rendered_agent_reads_its_parts_as_they_are(tiny_llama_dir):
    """No chat frame and no separators: token-id contexts, text and upstream outputs back to back;
    its leading contexts short of its last part are its static prefix."""
    from transformers import AutoTokenizer

    from aaflow.runtime.prompts import AgentInput, PromptBuilder

    builder = PromptBuilder(AutoTokenizer.from_pretrained(str(tiny_llama_dir)))  # one token per byte
    wf = af.Workflow("rendered")
    head, doc = wf.context("head", token_ids=[1, 2]), wf.context("doc", "Doc.")
    up = wf.agent("up", "m", ["Go."])
    wf.agent("one", "m", [head, doc, up, "End."], rendered=True)
    wf.agent("two", "m", [head, doc], rendered=True)
    segments = builder.segments(wf, wf.nodes["one"])
    assert segments == [(1, 2) + builder.ids("Doc."), AgentInput("up"), builder.ids("End.")]
    assert builder.prefix_part_lengths(wf, wf.nodes["one"]) == [2, 4]
    assert builder.segments(wf, wf.nodes["two"]) == [(1, 2), builder.ids("Doc.")]  # never the whole prompt
    wf.agent("bad", "m", [wf.context("huge", token_ids=[builder.vocab_size]), "x"], rendered=True)
    with pytest.raises(af.WorkflowError, match=f"context 'huge': token id {builder.vocab_size} is not in the model"):
        builder.segments(wf, wf.nodes["bad"])


def test_unserved_model_is_named():
    wf = review_workflow()
    with pytest.raises(af.WorkflowError, match="agent 'r0' uses model 'smollm2', which the cluster does not serve"):
        wf.validate(served_models={"qwen2"})
    wf.validate(served_models={"smollm2"})


def test_yaml_round_trip_with_forward_references():
    wf = workflow_from_dict({
        "name": "chain",
        "contexts": {"guide": "A style guide."},
        "agents": {
            "writer": {"model": "smollm2", "prompt": [{"ref": "guide"}, {"ref": "planner"}, "Write it."]},
            "planner": {"model": "smollm2", "prompt": [{"ref": "guide"}, "Plan it."], "max_tokens": 16},
        },
    })
    assert wf.topological_order() == ["guide", "planner", "writer"]
    assert wf.nodes["planner"].max_tokens == 16


def test_save_workflow_writes_a_yaml_that_loads_as_the_same_workflow(tmp_path):
    """Every setting that differs from its default, KV operator options and a conversation history
    survive the trip through YAML; the shipped review (contexts from files) does too."""
    from aaflow.configs import CONFIG_DIR

    wf = af.Workflow("all-settings")
    guide, notes = wf.context("guide", "A style guide: ünïcode kept."), wf.context("notes", "Notes.")
    both = wf.kv_op("both", "compose", guide, notes, mode="blend", r=0.3)
    a = wf.agent("a", "m", [both, "Plan it."], system="Be brief.", max_tokens=7, temperature=0.5, top_p=0.9, seed=3,
                 strategy="stream", ignore_eos=True, history=[("user", "Hi."), ("assistant", "Hello.")])
    wf.agent("b", "m", [guide, a, "Write it."], unordered=True)
    wf.agent("c", "m", [wf.context("ids", token_ids=[5, 0, 7]), "More."], rendered=True)
    wf.kv_op("drop", "evict", guide)
    for original in (wf, af.load_workflow(CONFIG_DIR / "workflows" / "review.yaml")):
        loaded = af.load_workflow(af.save_workflow(original, tmp_path / f"{original.name}.yaml"))
        assert loaded.name == original.name and loaded.nodes == original.nodes


def test_yaml_kv_operator_nodes_expand_into_the_prompt():
    wf = workflow_from_dict({
        "contexts": {"guide": "A style guide."},
        "kv_ops": {"shared": {"op": "fork", "inputs": ["guide"]}, "drop": {"op": "evict", "inputs": ["shared"]}},
        "agents": {"a": {"model": "m", "prompt": [{"ref": "shared"}, "Go."]}},
    })
    from aaflow.runtime.kvops import directive, evicted_contexts
    from aaflow.runtime.prompts import prompt_leaves

    agent = wf.nodes["a"]
    assert [getattr(x, "name", x) for x in prompt_leaves(wf, agent)] == ["guide", "Go."]
    assert directive(wf, agent).share_prefix and evicted_contexts(wf) == {"guide"}


def test_yaml_compose_nodes_name_their_mode_and_recompute_fraction():
    from aaflow.runtime.kvops import directive

    raw = {"contexts": {"a": "First.", "b": "Second."},
           "kv_ops": {"both": {"op": "compose", "inputs": ["a", "b"], "mode": "blend", "r": 0.3}},
           "agents": {"q": {"model": "m", "prompt": [{"ref": "both"}, "Go."]}}}
    wf = workflow_from_dict(raw)
    assert directive(wf, wf.nodes["q"]).compose == ("blend", 0.3)
    raw["kv_ops"]["both"]["mode"] = "exact"
    exact = workflow_from_dict(raw)
    assert directive(exact, exact.nodes["q"]).compose is None and directive(exact, exact.nodes["q"]).share_prefix
    for options, match in (({"mode": "glue"}, "unknown mode 'glue'"), ({"mode": "blend", "r": 2}, "r must be")):
        wf = af.Workflow("w")
        both = wf.kv_op("both", "compose", wf.context("a", "x"), wf.context("b", "y"), **options)
        wf.agent("q", "m", [both, "Go."])
        with pytest.raises(af.WorkflowError, match=match):
            directive(wf, wf.nodes["q"])


def test_evict_node_is_not_a_prompt_part():
    from aaflow.runtime.prompts import prompt_leaves

    wf = af.Workflow("w")
    doc = wf.context("doc", "text")
    drop = wf.kv_op("drop", "evict", doc)
    wf.agent("a", "m", [drop, "Go."])
    with pytest.raises(af.WorkflowError, match="evict node 'drop' cannot be a prompt part"):
        prompt_leaves(wf, wf.nodes["a"])


@pytest.mark.parametrize("raw, match", [
    ({"name": "w", "agentz": {}}, "unknown key 'agentz'"),
    ({"agents": {"a": {"model": "m", "prompt": ["x"], "max_token": 3}}}, "agent 'a': unknown key 'max_token'"),
    ({"agents": {"a": {"prompt": ["x"]}}}, "agent 'a': model and prompt are required"),
    ({"agents": {"a": {"model": "m", "prompt": [{"ref": "nope"}]}}}, "'a' refers to unknown node 'nope'"),
    ({"agents": {"a": {"model": "m", "prompt": [{"ref": "b"}]}, "b": {"model": "m", "prompt": [{"ref": "a"}]}}},
     "cycle"),
    ({"agents": {"a": {"model": "m", "prompt": [{"reff": "b"}]}}}, "unknown key 'reff'"),
    ({"contexts": {"c": {"file": "missing.txt"}}, "agents": {}}, "file .*missing.txt does not exist"),
    ({"contexts": {"c": "x"}}, "has no agents"),
    ({"contexts": {"c": "x"}, "kv_ops": {"k": {"op": "fork", "inputs": ["c"], "replicas": "r"}}, "agents": {}},
     "kv op 'k': unknown key 'replicas'"),
    ({"contexts": {"c": "x"}, "kv_ops": {"k": {"op": "teleport", "inputs": ["c"]}}, "agents": {}}, "teleport"),
    ({"kv_ops": {"k": {"op": "fork", "inputs": ["ghost"]}}, "agents": {}}, "'k' refers to unknown node 'ghost'"),
    ({"contexts": {"c": {"token_ids": [1], "text": "x"}}}, "context 'c': give token_ids alone"),
])
def test_yaml_validation_errors(raw, match, tmp_path):
    with pytest.raises(af.WorkflowError, match=match):
        workflow_from_dict(raw, base_dir=tmp_path)


def test_load_workflow_reports_bad_yaml(tmp_path):
    bad = tmp_path / "w.yaml"
    bad.write_text("agents: [unclosed")
    with pytest.raises(af.WorkflowError, match="not valid YAML"):
        af.load_workflow(bad)
    with pytest.raises(af.WorkflowError, match="does not exist"):
        af.load_workflow(tmp_path / "none.yaml")


def test_the_demo_review_workflow_repeats_its_paper_and_keeps_its_agents():
    from aaflow.demo import review_workflow

    shipped, long = review_workflow(0), review_workflow(2000)
    paper = shipped.nodes["paper"].text
    assert long.nodes["paper"].text == "\n\n".join([paper] * 4)  # 2,000 / 560 tokens per copy
    assert [(a.name, a.prompt, a.max_tokens, a.ignore_eos) for a in long.agents()] == \
        [(a.name, a.prompt, a.max_tokens, a.ignore_eos) for a in shipped.agents()]
    assert all(a.ignore_eos for a in review_workflow(2000, ignore_eos=True).agents())
