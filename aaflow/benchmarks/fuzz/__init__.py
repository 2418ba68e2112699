"""Property-based fuzzing of aaflow's input surfaces (Hypothesis): every failure must be a typed
`AAFlowError`, nothing may hang, and pools must hold nothing a case did not keep.

Surfaces: `workflow_graphs` (the DSL), `yaml_files` (mutated workflow files), `operator_arguments`
(the `af.*` operators with bad refs and arguments), `kv_payloads` (imported KV, spilled files,
transport control messages and received descriptors), all in this process, and `workflow_runs`
(random small workflows run with `af.run` on a 2-replica Ray cluster). `tests/frontend/test_fuzz.py` runs a small budget of
each; `aaflow bench fuzz` runs >= 1,000 cases per surface and writes the counts.

Layer: front end.
"""

from __future__ import annotations

from pathlib import Path

from aaflow.benchmarks.fuzz.graphs import WorkflowGraphs
from aaflow.benchmarks.fuzz.harness import Surface, SurfaceReport, run_surface
from aaflow.benchmarks.fuzz.op_args import OperatorArguments
from aaflow.benchmarks.fuzz.payloads import KVPayloads
from aaflow.benchmarks.fuzz.runs import WorkflowRuns
from aaflow.benchmarks.fuzz.yaml_files import YamlFiles

SURFACE_NAMES = ("workflow_graphs", "yaml_files", "operator_arguments", "kv_payloads")  # in this process
RAY_SURFACE_NAMES = ("workflow_runs",)  # start a local Ray cluster
MAX_POSITIONS = 4096  # room for the shipped review workflow's paper (byte tokens) in the tiny model


def make_models(folder: Path) -> tuple[Path, Path]:
    """Two tiny random-weight models (a Llama and a Qwen2: another model's fingerprint) under `folder`."""
    from aaflow.models.tiny import make_tiny_model

    return tuple(make_tiny_model(folder / arch, arch, max_position_embeddings=MAX_POSITIONS)
                 for arch in ("llama", "qwen2"))


def make_surface(name: str, model_dir: Path, other_model_dir: Path) -> Surface:
    """The surface called `name` (one of `SURFACE_NAMES`) on these tiny models; enter it before running."""
    if name == "workflow_graphs":
        return WorkflowGraphs(str(model_dir))
    if name == "yaml_files":
        return YamlFiles(str(model_dir))
    if name == "operator_arguments":
        return OperatorArguments(model_dir, other_model_dir)
    if name == "kv_payloads":
        return KVPayloads(model_dir, other_model_dir)
    if name == "workflow_runs":
        return WorkflowRuns(str(model_dir))
    raise ValueError(f"unknown fuzz surface {name!r}; choose from {SURFACE_NAMES + RAY_SURFACE_NAMES}")


__all__ = ["RAY_SURFACE_NAMES", "SURFACE_NAMES", "Surface", "SurfaceReport", "make_models", "make_surface",
           "run_surface"]
