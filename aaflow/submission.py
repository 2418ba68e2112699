"""`af.submit`: run a workflow on a running deployment (`aaflow up`), from any number of clients."""

from __future__ import annotations

import os

from aaflow.running import run
from aaflow.workflow_files import load_workflow
from aaflow.cluster.cluster import Cluster
from aaflow.cluster.deployment import connect


def submit(workflow, target=None, *, strategy: str = "auto", on_token=None, on_agent=None, **run_options):
    """Run `workflow` (a `Workflow` or a workflow YAML path) on a deployment: `target` is a cluster
    from `af.connect`, a Ray address, or None for RAY_ADDRESS (as inside a Ray job).

    The run goes to the deployment's one scheduling loop (its `scheduler` actor): any number of
    clients may submit at once, their agents are batched together, and each reuses what the
    replicas' prefix cache and pins hold. Tokens stream back as agents produce them: `on_token(agent, token_id)` per token,
    `on_agent(agent, text)` as each agent finishes. Returns the `RunResult` `af.run` gives;
    `run_options` go to `af.run` (chunk_tokens, call_timeout_s, transport, plan, ...).
    Raises `DeploymentError` when no deployment runs there.
    """
    if isinstance(workflow, (str, os.PathLike)):
        workflow = load_workflow(workflow)
    cluster = target if isinstance(target, Cluster) else connect(target)
    try:
        return run(workflow, cluster, strategy=strategy, on_token=on_token, on_agent=on_agent, **run_options)
    finally:
        if cluster is not target:
            cluster.shutdown()
