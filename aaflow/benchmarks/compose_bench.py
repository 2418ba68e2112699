"""`aaflow bench compose`: fidelity and time of approximate compose (rerotate, blend at several r).

For pairs of independent passages A and B (each materialized alone), compose(A, B) is compared
with a full recompute of A+B. A prompt is a pair and one of the questions of the passages file, so
every pair is asked every question. Per prompt:
- `top1_next_token`: whether the top-1 next token after the prompt (A+B+question) agrees, and its
  KL divergence: the issue's metric;
- the reference greedily answers (24 tokens); question + answer are teacher-forced through both
  KVs: `top1_agreement` over every position, `top1_answer` over those predicting the answer.
Time saved = full prefill of A+B vs the compose itself.

Passages come from `aaflow/configs/bench/passages.yaml` (40-60 tokens each), or with `--source
python-docs` from the Python reference shipped with the interpreter (`pydoc_data`), cut to
`--segment-tokens` tokens: RAG-sized chunks rather than paragraphs.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import yaml

from aaflow.benchmarks.common import add_dtype_argument, log, machine_facts, write_json
from aaflow.configs import CONFIG_DIR


def run(args) -> dict:
    if getattr(args, "quick", False):
        args.pairs, args.ratios = 4, [0.15]
    import aaflow as af
    from aaflow.operators import KVHost
    from aaflow.operators.compose import agreement_by_position

    torch.set_num_threads(args.threads)
    data = yaml.safe_load((CONFIG_DIR / "bench" / "passages.yaml").read_text())
    engine = af.Engine.from_pretrained(args.model, dtype=args.dtype, prefix_caching=False)
    host = KVHost(engine, name="bench")
    system = engine.encode("<|im_start|>system\nYou answer questions about the passages.<|im_end|>\n<|im_start|>user\n")
    passages = _passages(engine, args.source, data, args.segment_tokens)
    pairs = list(itertools.permutations(range(len(passages)), 2))
    if args.pairs:  # a subset, spread over every passage
        pairs = pairs[:: max(1, len(pairs) // args.pairs)][: args.pairs]
    modes = [("rerotate", 0.0)] + [("blend", r) for r in args.ratios]
    rows: dict[str, list[dict]] = {f"{m}@{r}" if m == "blend" else m: [] for m, r in modes}
    questions = [engine.encode(q + "<|im_end|>\n<|im_start|>assistant\n") for q in data["questions"]]
    newline = engine.encode("\n")
    for n, (i, j) in enumerate(pairs):
        a_ids, b_ids = system + passages[i] + newline, passages[j] + newline
        t0 = time.perf_counter()
        seq = engine.new_sequence()
        engine.prefill(seq, a_ids + b_ids)
        full_s = time.perf_counter() - t0
        engine.free(seq)
        a, b = af.materialize(host, a_ids), af.materialize(host, b_ids)
        for qn, question in enumerate(questions):
            answer = engine.generate(a_ids + b_ids + question, max_new_tokens=args.answer_tokens).token_ids
            probe = question + answer
            for mode, r in modes:
                t0 = time.perf_counter()
                c = af.compose(a, b, mode=mode, r=r)
                compose_s = time.perf_counter() - t0
                agree, kl = agreement_by_position(host, host.sequence(c), list(c.token_ids), probe)
                key = f"{mode}@{r}" if mode == "blend" else mode
                first = len(question) - 1  # the position after the prompt: predicts answer[0]
                rows[key].append({"pair": [i, j], "question": qn, "compose_s": compose_s, "full_prefill_s": full_s,
                                  "top1_next_token": float(agree[first]), "kl_next_token": float(kl[first]),
                                  "top1_agreement": float(agree.mean()), "kl": float(kl.mean()),
                                  "top1_answer": float(agree[first:-1].mean()),
                                  "recomputed": c.fidelity.recomputed_tokens, "tokens": c.fidelity.total_tokens})
                af.free(c)
        af.free(a)
        af.free(b)
        log(f"pair {n + 1}/{len(pairs)}: " + ", ".join(
            f"{k} next-token {statistics.mean(x['top1_next_token'] for x in v):.3f}" for k, v in rows.items()))
    summary = {k: {"top1_next_token_mean": statistics.mean(x["top1_next_token"] for x in v),
                   "kl_next_token_median": statistics.median(x["kl_next_token"] for x in v),
                   "prompts": len(v),
                   "top1_agreement_mean": statistics.mean(x["top1_agreement"] for x in v),
                   "top1_answer_mean": statistics.mean(x["top1_answer"] for x in v),
                   "kl_median": statistics.median(x["kl"] for x in v),
                   "compose_s_median": statistics.median(x["compose_s"] for x in v),
                   "full_prefill_s_median": statistics.median(x["full_prefill_s"] for x in v),
                   "recomputed_fraction": statistics.mean(x["recomputed"] / x["tokens"] for x in v)}
               for k, v in rows.items()}
    for k, s in summary.items():
        log(f"{k:>12}: next token {s['top1_next_token_mean']:.3f} over {s['prompts']} prompts; over question + "
            f"answer {s['top1_agreement_mean']:.3f} (answer only {s['top1_answer_mean']:.3f}), "
            f"KL median {s['kl_median']:.4f}, "
            f"compose {s['compose_s_median'] * 1e3:.0f} ms vs full prefill {s['full_prefill_s_median'] * 1e3:.0f} ms")
    report = {"benchmark": "compose", "machine": machine_facts(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
              "summary": summary, "rows": rows}
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    add_dtype_argument(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", type=int, default=0,
                   help="how many ordered passage pairs (0: all; the 8 shipped passages make 56)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.3])
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--source", choices=["passages", "python-docs"], default="passages",
                   help="short passages (aaflow/configs/bench/passages.yaml) or sections of the Python reference")
    p.add_argument("--segment-tokens", type=int, default=0,
                   help="cut every passage to this many tokens (0: whole; python-docs needs it)")
    p.add_argument("--out", default="results/compose.json")
    p.add_argument("--quick", action="store_true", help="four pairs, r = 0.15 only")


PYTHON_DOCS_TOPICS = ("assignment", "attribute-access", "calls", "comparisons", "execmodel", "import", "naming",
                      "try", "function", "sequence-types", "numeric-types", "objects")


def _passages(engine, source: str, data: dict, segment_tokens: int) -> list[list[int]]:
    """Token ids of each passage, cut to `segment_tokens` when that is set."""
    if source == "python-docs":
        if segment_tokens <= 0:
            raise SystemExit("--source python-docs needs --segment-tokens N (its sections run to thousands of tokens)")
        from pydoc_data.topics import topics

        texts = [topics[name] for name in PYTHON_DOCS_TOPICS]
    else:
        texts = data["passages"]
    ids = [engine.encode(t) for t in texts]
    return [x[:segment_tokens] for x in ids] if segment_tokens > 0 else ids


def _plot(out, report) -> None:
    from aaflow.benchmarks.plots import write_plot

    summary = report["summary"]
    write_plot(out, [
        {"title": "top-1 agreement with full recompute", "kind": "bar", "ylabel": "fraction",
         "series": {"next token": {m: v["top1_next_token_mean"] for m, v in summary.items()},
                    "question + answer": {m: v["top1_agreement_mean"] for m, v in summary.items()}},
         "hlines": {"target": 0.95}},
        {"title": "compose time vs full prefill", "kind": "bar", "ylabel": "ms",
         "series": {m: {"compose": v["compose_s_median"] * 1e3, "full prefill": v["full_prefill_s_median"] * 1e3}
                    for m, v in summary.items()}},
    ])
