"""The loads `aaflow bench serve` offers both sides: small three-agent workflows over shared documents.

Each workflow: agent `a` reads a document and answers; `c` reads the document and answers another
question; `b` reads the document and `a`'s answer. Workflow i reads document i % documents, so
with 64 workflows over 8 documents each document is read by 24 agents of 8 workflows; in the
skewed shape a few hot documents are read by four workflows in five. Arrival
offsets: all at once (a burst), or Poisson at a rate (workflows per second, seeded).
"""

from __future__ import annotations

import random


def serve_workflow(i: int, document: str, max_tokens: int, ignore_eos: bool = True):
    """Workflow `serve-i`: a and c read `document`; b reads it and a's answer."""
    import aaflow as af

    wf = af.Workflow(f"serve-{i}")
    doc = wf.context("doc", document)
    a = wf.agent("a", "smollm2", [doc, "List the two main claims of this text."], max_tokens=max_tokens,
                 ignore_eos=ignore_eos)
    wf.agent("b", "smollm2", [doc, "Claims:", a, "Which claim is the stronger one, and why?"],
             max_tokens=max_tokens, ignore_eos=ignore_eos)
    wf.agent("c", "smollm2", [doc, "Give this text a short title."], max_tokens=max_tokens, ignore_eos=ignore_eos)
    return wf


def documents(count: int, tokens: int) -> list[str]:
    """`count` distinct documents of about `tokens` SmolLM2 tokens each (the shipped paper, rotated)."""
    from aaflow.benchmarks.scaling_bench import context_text

    return [context_text(tokens, 997 * k) for k in range(count)]


def serve_workflows(count: int, docs: list[str], max_tokens: int, ignore_eos: bool = True, hot: int = 0) -> list:
    """`count` workflows over `docs`: workflow i reads document i % len(docs); with `hot` > 0 (the
    skewed shape), four workflows in five read one of the first `hot` documents and the fifth one
    of the others."""
    return [serve_workflow(i, docs[document_of(i, len(docs), hot)], max_tokens, ignore_eos) for i in range(count)]


def document_of(i: int, documents: int, hot: int = 0) -> int:
    """The document workflow i reads (see `serve_workflows`)."""
    if not hot:
        return i % documents
    if not 0 < hot < documents:
        raise ValueError(f"--hot-documents must be between 1 and --documents - 1 ({documents - 1}), got {hot}")
    return i % hot if i % 5 != 4 else hot + (i // 5) % (documents - hot)


def warm_up_load() -> list:
    """The small load both sides run untimed before measuring (aaflow builds its kernels, vLLM its graphs)."""
    return serve_workflows(1, documents(1, 200), 4)


def shape_key(shape: str, ignore_eos: bool) -> str:
    """A load's name in the JSON: its arrival shape, with " (eos)" where agents stop at end-of-sequence."""
    return f"{shape}{'' if ignore_eos else ' (eos)'}"


def arrivals(count: int, rate_per_s: float | None, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds: all 0 (burst) when `rate_per_s` is None, else a Poisson process."""
    if rate_per_s is None:
        return [0.0] * count
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (`q` in 0..1) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]


def loads_and_shapes(args) -> tuple[dict, list]:
    """The workflows per end-of-sequence mode ({ignore_eos: workflows}) and the shapes (name,
    Poisson rate or None for the burst) that `args` ask for."""
    docs = documents(args.documents, args.doc_tokens)
    eos_modes = [True, False] if args.both_eos else [True]
    skew = f"skewed ({args.hot_documents} hot) " if args.hot_documents else ""
    shapes = [(f"{skew}burst", None)] + [(f"{skew}poisson-{r:g}/s", r) for r in args.rates]
    loads = {ignore_eos: serve_workflows(args.workflows, docs, args.max_tokens, ignore_eos, args.hot_documents)
             for ignore_eos in eos_modes}
    return loads, shapes
