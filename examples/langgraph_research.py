"""A LangGraph research graph (planner -> researchers fan-out -> writer) on an aaflow endpoint.

The graph is plain LangGraph; the one aaflow line is the chat model: `AAFlowChat` instead of
`ChatOpenAI`. Start a deployment and its endpoint first:

    ray start --head --node-ip-address=127.0.0.1 --port=6379
    aaflow up --address 127.0.0.1:6379 --replicas smollm2=2
    aaflow serve --address 127.0.0.1:6379 &
    python examples/langgraph_research.py --model smollm2

`dsl_workflow` is the same graph in aaflow's own DSL: the same prompts, so the same answers.
"""

from __future__ import annotations

import argparse
import operator
from typing import Annotated, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

SYSTEM = "You are a precise research assistant."
DOCUMENT = ("Agents in a workflow keep re-reading the same long context, and a downstream agent waits for its "
            "upstream agent to finish decoding before it starts its own prefill. A KV-state runtime keeps the "
            "context's attention state once and moves it between model replicas instead of recomputing it.")
PLAN = "List three research questions about the document."
WRITE = "Write a short report from these notes."


def research(i: int) -> str:
    return f"Answer research question {i + 1} of the plan above."


class State(TypedDict):
    plan: str
    notes: Annotated[list[str], operator.add]
    report: str


def build_graph(llm, researchers: int = 3):
    """planner -> `researchers` researchers (a `Send` fan-out) -> writer, each node one chat call."""

    def ask(prompt: str) -> str:
        return llm.invoke([SystemMessage(SYSTEM), HumanMessage(prompt)]).content

    def planner(state: State) -> dict:
        return {"plan": ask(f"{DOCUMENT}\n\n{PLAN}")}

    def fan_out(state: State) -> list[Send]:
        return [Send("researcher", {"plan": state["plan"], "index": i}) for i in range(researchers)]

    def researcher(task: dict) -> dict:
        return {"notes": [ask(f"{DOCUMENT}\n\n{task['plan']}\n\n{research(task['index'])}")]}

    def writer(state: State) -> dict:
        return {"report": ask("\n\n".join(state["notes"] + [WRITE]))}

    graph = StateGraph(State)
    graph.add_node("planner", planner)
    graph.add_node("researcher", researcher)
    graph.add_node("writer", writer)
    graph.add_edge(START, "planner")
    graph.add_conditional_edges("planner", fan_out, ["researcher"])
    graph.add_edge("researcher", "writer")
    graph.add_edge("writer", END)
    return graph.compile()


def dsl_workflow(model: str, researchers: int = 3, max_tokens: int = 32):
    """The same graph as an aaflow workflow (the writer reads the notes in the researchers' order)."""
    import aaflow as af

    wf = af.Workflow("research")
    doc = wf.context("document", DOCUMENT)
    plan = wf.agent("planner", model, [doc, PLAN], system=SYSTEM, max_tokens=max_tokens)
    notes = [wf.agent(f"researcher[{i}]", model, [doc, plan, research(i)], system=SYSTEM, max_tokens=max_tokens)
             for i in range(researchers)]
    wf.agent("writer", model, [*notes, WRITE], system=SYSTEM, max_tokens=max_tokens)
    return wf


def main() -> None:
    from aaflow.integrations.langgraph import AAFlowChat

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    llm = AAFlowChat(base_url=args.base_url, model=args.model, temperature=0, max_tokens=args.max_tokens)
    out = build_graph(llm).invoke({"plan": "", "notes": [], "report": ""})
    print("plan:", out["plan"], "\n")
    for i, note in enumerate(out["notes"]):
        print(f"note {i + 1}:", note, "\n")
    print("report:", out["report"])


if __name__ == "__main__":
    main()
