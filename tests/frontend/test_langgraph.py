"""A LangGraph program on aaflow's endpoint (aaflow/integrations/langgraph.py): the example graph
(planner -> three researchers -> writer) run through `AAFlowChat` over real HTTP equals aaflow's
own DSL run of the same graph, on SmolLM2 in fp32; its calls carry the node names as hints."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

import aaflow as af
from aaflow.benchmarks.ray_head import REPO, free_ports

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")
pytest.importorskip("uvicorn")

MAX_TOKENS = 16


def _example():
    spec = importlib.util.spec_from_file_location("langgraph_research", REPO / "examples" / "langgraph_research.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # LangGraph reads the state's type hints through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def endpoint(smollm2_dir):
    from aaflow.serving import BackgroundServer, serving_app

    model = str(smollm2_dir)
    cluster = af.init(replicas={model: 1}, dtype="float32")
    seen: list[dict] = []
    app = serving_app(cluster)

    @app.middleware("http")
    async def record(request, call_next):  # the hints each call carries
        body = await request.body()
        if body:
            seen.append(json.loads(body).get("agent_hints") or {})
        return await call_next(request)

    server = BackgroundServer(app, port=free_ports(1)[0])
    yield cluster, model, f"{server.url}/v1", seen
    server.stop()
    cluster.shutdown()


def test_the_example_graph_answers_as_the_dsl_workflow_does(endpoint):
    from aaflow.integrations.langgraph import AAFlowChat

    cluster, model, base_url, seen = endpoint
    example = _example()
    llm = AAFlowChat(base_url=base_url, model=model, temperature=0, max_tokens=MAX_TOKENS)
    out = example.build_graph(llm).invoke({"plan": "", "notes": [], "report": ""})
    dsl = af.run(example.dsl_workflow(model, max_tokens=MAX_TOKENS), cluster, strategy="text")
    assert out["plan"] == dsl["planner"].text
    assert out["notes"] == [dsl[f"researcher[{i}]"].text for i in range(3)]
    assert out["report"] == dsl["writer"].text
    agents = sorted(h.get("agent_id", "") for h in seen)
    assert agents == ["planner", "researcher[0]", "researcher[1]", "researcher[2]", "writer"], seen
    assert len({h["workflow_id"] for h in seen}) == 1


def test_streaming_through_langchain(endpoint):
    from aaflow.integrations.langgraph import AAFlowChat

    _, model, base_url, _ = endpoint
    llm = AAFlowChat(base_url=base_url, model=model, temperature=0, max_tokens=MAX_TOKENS)
    whole = llm.invoke("Name a color.").content
    assert "".join(chunk.content for chunk in llm.stream("Name a color.")) == whole
