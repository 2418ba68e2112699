"""What the fuzzer found, one regression test each: bad input is a typed error naming the problem,
and `fork` under a KV budget returns live forks."""

from __future__ import annotations

import pytest

import aaflow as af
from aaflow.operators import EvictionPolicy, KVHost


@pytest.fixture
def host(tiny_engine):
    h = KVHost(tiny_engine)
    yield h
    h.close()


def test_fork_under_a_budget_that_evicts_its_source_returns_live_forks(tiny_engine):
    host = KVHost(tiny_engine, policy=EvictionPolicy(budget_bytes=0))  # every registration evicts the others
    kv = af.materialize(host, list(range(40, 80)))
    forks = af.fork(kv, 3)
    assert [f.token_ids for f in forks] == [kv.token_ids] * 3
    assert af.generate(forks[0], [5], 2).token_ids  # rebuilt from lineage where evicted
    host.close()


@pytest.mark.parametrize("op, call", [
    ("fork", lambda: af.fork(None, 2)), ("evict", lambda: af.evict("kv-1")), ("free", lambda: af.free(3)),
    ("compose", lambda: af.compose("a", "b")), ("generate", lambda: af.generate([], "x")),
])
def test_an_operator_given_something_else_than_a_kvref_names_it(op, call):
    with pytest.raises(af.InvalidArgumentError, match=f"{op} needs a KVRef"):
        call()


@pytest.mark.parametrize("prompt", [None, 5, [1.5], ["7"], [True], "\ud800"])
def test_prompts_that_are_not_text_or_token_ids_are_prompt_errors(host, prompt):
    with pytest.raises(af.PromptError):
        af.materialize(host, prompt)


@pytest.mark.parametrize("call, error", [
    (lambda kv: af.fork(kv, 0), "fork needs n >= 1"),
    (lambda kv: af.pin(kv, "x"), "ttl_s must be a finite number"),
    (lambda kv: af.extend(kv, [5], chunk_size=0), "chunk_size must be an int >= 1"),
    (lambda kv: af.evict(kv, spill=True), "no spill_dir"),
])
def test_out_of_range_operator_arguments_are_invalid_argument_errors(host, call, error):
    kv = af.materialize(host, [5, 6, 7])
    with pytest.raises(af.InvalidArgumentError, match=error):
        call(kv)


def test_generate_refuses_unknown_keywords_and_takes_one_stop_string(host):
    kv = af.materialize(host, [5, 6, 7])
    with pytest.raises(af.SamplingError, match="unknown sampling keyword 'temprature'"):
        af.generate(kv, [8], 2, temprature=0.5)
    assert af.generate(kv, [8], 2, stop="ab").token_ids  # one string, not the characters 'a', 'b'


def test_imports_of_damaged_payloads_are_kv_import_errors(tiny_engine, tmp_path):
    from aaflow.operators import KVPayload
    from aaflow.operators.spill import load_spilled, spill_export

    seq = tiny_engine.new_sequence()
    tiny_engine.prefill(seq, [5, 6, 7])
    export = tiny_engine.export_kv(seq)
    tiny_engine.free(seq)
    for payload, message in [
        (KVPayload(export.fingerprint, (5, 6, -1), export.kv), "not ids of this model's vocabulary"),
        (KVPayload(export.fingerprint, 3, export.kv), "must be a list of ints"),
        (KVPayload(export.fingerprint, export.token_ids, export.kv.numpy()), "must be a torch.Tensor"),
        (KVPayload(None, export.token_ids, export.kv), "computed by model None"),
    ]:
        with pytest.raises(af.KVImportError, match=message):
            tiny_engine.import_kv(payload)
    path = spill_export(export, tmp_path / "kv.safetensors")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(af.KVImportError, match="not a readable spilled KV file"):
        load_spilled(path, export.fingerprint)


@pytest.mark.parametrize("raw, message", [
    ({"contexts": ["a"], "agents": {}}, "contexts must be a mapping"),
    ({"agents": {"a": {"model": "m", "prompt": [{}]}}}, "a prompt reference must be"),
    ({"agents": {"a": {"model": "m", "prompt": [{"ref": ["x"]}]}}}, "a prompt reference must be"),
    ({"agents": {"a": {"model": "m", "prompt": "x", "temperature": "hot"}}}, "temperature must be"),
    ({"agents": {"a": {"model": 5, "prompt": "x"}}}, "model must be"),
    ({"contexts": {"c": {"text": "x", 1: 2}}, "agents": {}}, "unknown key 1"),
    ({"contexts": {"c": {"file": "."}}, "agents": {}}, "is not a file"),
    ({"agents": {"a": {"model": "m", "prompt": "x"}}, "kv_ops": {"k": {"op": "fork"}}}, "needs at least one input"),
])
def test_malformed_workflow_mappings_are_workflow_errors(raw, message):
    from aaflow.workflow_files import workflow_from_dict

    with pytest.raises(af.WorkflowError, match=message):
        workflow_from_dict(raw)


def test_a_workflow_file_that_is_not_utf8_is_a_workflow_error(tmp_path):
    path = tmp_path / "wf.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(af.WorkflowError, match="UTF-8"):
        af.load_workflow(path)


def test_hand_wired_prompt_parts_are_caught_by_validate():
    from aaflow.workflow.graph import AgentNode

    wf = af.Workflow("w")
    wf.nodes["a"] = AgentNode("a", "m", ({"not": "a handle"},))
    with pytest.raises(af.WorkflowError, match="neither a string nor a node handle"):
        wf.validate()


@pytest.mark.parametrize("cluster, strategy, match", [
    (None, "auto", "the cluster must be"), (None, "fastest", "the cluster must be"),
    ("cluster", "fastest", "unknown strategy 'fastest'")])
def test_a_run_without_a_cluster_or_with_an_unknown_strategy_is_a_typed_error(cluster, strategy, match):
    cluster = type("NotACluster", (), {"replicas": (), "models": ()})() if cluster else None
    with pytest.raises(af.AAFlowError, match=match):
        af.run(af.Workflow("w"), cluster, strategy=strategy)


def test_importing_something_else_than_an_export_is_a_kv_import_error(tiny_engine):
    with pytest.raises(af.KVImportError, match="takes a KVExport"):
        tiny_engine.import_kv(object())
