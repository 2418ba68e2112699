"""Mutated workflow YAML files: the shipped review workflow (and one with KV operator nodes), edited
structurally (keys deleted, values replaced by random YAML, unknown keys, references renamed to
dangling or cyclic names) and then textually (truncated, spliced, bytes flipped, YAML tags and
anchors injected), written to a file next to its context file and loaded with `af.load_workflow`;
what loads is planned offline as `af.run` would before running it. Every refusal must be typed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from aaflow.benchmarks.fuzz.harness import Surface

REVIEW = Path(__file__).resolve().parents[2] / "configs" / "workflows" / "review.yaml"
WITH_OPS = {
    "name": "ops",
    "contexts": {"doc": "A shared document.", "guide": {"text": "Be brief."}},
    "agents": {
        "a": {"model": "MODEL", "prompt": [{"ref": "shared"}, "Summarize."], "max_tokens": 8},
        "b": {"model": "MODEL", "prompt": [{"ref": "both"}, {"ref": "a"}, "Critique."], "strategy": "stream"},
    },
    "kv_ops": {"shared": {"op": "fork", "inputs": ["doc"]},
               "both": {"op": "compose", "inputs": ["guide", "doc"], "mode": "rerotate"}},
}
INJECT = ["!!python/object/apply:os.system ['true']", "&a [*a]", "*undefined", "\t", "{", "]", ": :", "---\n",
          "%YAML 9.9\n", "!!binary AAAA", "? [a, b]\n: c", "\x00", "\ufeff", "ref: ref"]


def _strategies():
    from hypothesis import strategies as st

    chars = st.characters(blacklist_categories=("Cs",))
    scalar = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats() | st.text(chars, max_size=12)
    value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(
        st.text(chars, max_size=6) | st.integers(0, 3), c, max_size=3), max_leaves=6)
    edit = st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4),
                     st.sampled_from(["delete", "replace", "unknown_key", "rename_ref"]), value)
    text_edit = st.tuples(st.sampled_from(["truncate", "splice", "flip", "inject", "duplicate_line"]),
                          st.floats(0, 1), st.integers(0, 255), st.sampled_from(INJECT) | st.text(chars, max_size=8))
    text_edits = st.integers(0, 1).flatmap(lambda i: st.lists(text_edit, min_size=1, max_size=2) if i else st.just([]))
    return st.tuples(st.booleans(), st.lists(edit, max_size=2), text_edits)


def _edit(raw, path: list[int], action: str, value) -> None:
    """Walk `raw` down `path` (indices into each level's keys), then apply `action` there."""
    node = raw
    for depth, index in enumerate(path):
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            return
        key = keys[index % len(keys)]
        child = node[key]
        if depth == len(path) - 1 or not isinstance(child, (dict, list)):
            if action == "delete":
                del node[key]
            elif action == "replace":
                node[key] = value
            elif action == "unknown_key" and isinstance(node, dict):
                node[f"bogus_{index}"] = value
            elif action == "rename_ref" and isinstance(child, dict) and "ref" in child:
                child["ref"] = ["a", "paper", "meta", "nowhere", ""][index % 5]
            elif action == "rename_ref" and isinstance(node, dict) and key == "ref":
                node[key] = "meta"  # a reviewer reading the meta-review: a cycle
            return
        node = child


def _mutate_text(data: bytes, action: str, where: float, byte: int, text: str) -> bytes:
    at = int(where * len(data))
    if action == "truncate":
        return data[:at]
    if action == "splice":
        return data[:at] + data[at + byte % 40:]
    if action == "flip":
        return data[:at] + bytes([byte]) + data[at + 1:]
    if action == "inject":
        return data[:at] + text.encode("utf-8", "surrogatepass") + data[at:]
    lines = data.split(b"\n")
    line = int(where * (len(lines) - 1))
    return b"\n".join(lines[:line + 1] + lines[line:])


class YamlFiles(Surface):
    """Mutated workflow files loaded and planned (see the module doc)."""

    name = "yaml_files"

    def __init__(self, model: str) -> None:
        self.model = model

    def __enter__(self) -> "YamlFiles":
        import yaml

        super().__enter__()
        self.dir = Path(tempfile.mkdtemp(prefix="aaflow-fuzz-yaml-"))
        shutil.copy(REVIEW.parent / "paper.txt", self.dir / "paper.txt")
        review = yaml.safe_load(REVIEW.read_text())
        for agent in review["agents"].values():
            agent["model"] = self.model
        with_ops = yaml.safe_load(yaml.safe_dump(WITH_OPS).replace("MODEL", self.model))
        self.seeds = [review, with_ops]
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def cases(self):
        return _strategies()

    def run(self, case) -> None:
        import copy

        import yaml

        import aaflow as af

        which, edits, text_edits = case
        raw = copy.deepcopy(self.seeds[int(which)])
        for path, action, value in edits:
            _edit(raw, path, action, value)
        data = yaml.safe_dump(raw, allow_unicode=True).encode("utf-8")
        for action, where, byte, text in text_edits:
            data = _mutate_text(data, action, where, byte, text)
        path = self.dir / "workflow.yaml"
        path.write_bytes(data)
        wf = af.load_workflow(path)
        self.steps["loaded"] += 1
        af.plan(wf, {self.model: 2}, hardware="h100", progress=None, dtype="float32")
        self.steps["planned"] += 1
