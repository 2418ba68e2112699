"""Checks of what a workflow's nodes are built from: each raises `WorkflowError` naming the node
and the value at fault."""

from __future__ import annotations

import math
import numbers

from aaflow.common.errors import WorkflowError


def check_unicode(owner: str, text: str) -> None:
    """`WorkflowError` for text no tokenizer can encode (unpaired surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise WorkflowError(f"{owner}: the text is not valid unicode ({exc.reason} at character {exc.start}); "
                            "remove unpaired surrogates") from exc


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_rendered(name: str, rendered, system, history, parts) -> None:
    """`WorkflowError` naming what keeps an agent's prompt from being taken as already rendered."""
    if rendered is not True:
        raise WorkflowError(f"agent {name!r}: rendered must be true or false, got {rendered!r}")
    if system is not None or history:
        raise WorkflowError(f"agent {name!r}: a rendered prompt has its system prompt and earlier turns in it "
                            "already; give no system or history")
    if len(parts) < 2 or getattr(parts[0], "kind", None) != "context":  # parts[0]: a string or a `Ref`
        raise WorkflowError(f"agent {name!r}: a rendered prompt must start with a context (its shareable prefix, "
                            "at least the chat header) and have another part after it")


def checked_ids(name: str, token_ids) -> tuple[int, ...]:
    """`token_ids` as a tuple of ints; `WorkflowError` unless it is a non-empty list of integers >= 0."""
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise WorkflowError(f"context {name!r}: token_ids must be a non-empty list of ints, got {token_ids!r:.40}")
    bad = next((t for t in token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0), None)
    if bad is not None:
        raise WorkflowError(f"context {name!r}: token ids must be ints >= 0, got {bad!r}")
    return tuple(int(t) for t in token_ids)


def checked_history(name: str, history) -> tuple[tuple[str, str], ...]:
    """`history` as (role, content) pairs; `WorkflowError` naming the first bad turn."""
    if not isinstance(history, (list, tuple)):
        raise WorkflowError(f"agent {name!r}: history must be a list of turns, got {type(history).__name__}")
    turns = []
    for i, turn in enumerate(history):
        role, content = (turn.get("role"), turn.get("content")) if isinstance(turn, dict) else (
            turn if isinstance(turn, (list, tuple)) and len(turn) == 2 else (None, None))
        if role not in ("user", "assistant") or not isinstance(content, str):
            raise WorkflowError(f"agent {name!r}: history turn {i} must have role 'user' or 'assistant' and string "
                                f"content, got {turn!r:.80}")
        check_unicode(f"agent {name!r}'s history turn {i}", content)
        turns.append((role, content))
    return tuple(turns)


def check_agent_settings(name, model, system, max_tokens, temperature, top_p, seed, unordered, ignore_eos) -> None:
    """`WorkflowError` naming the first agent setting of the wrong type or out of range."""
    if not isinstance(model, str) or not model.strip():
        raise WorkflowError(f"agent {name!r}: model must be a served model's name (a non-empty string), got {model!r}")
    if system is not None and not isinstance(system, str):
        raise WorkflowError(f"agent {name!r}: system must be a string or None, got {type(system).__name__}")
    if system is not None:
        check_unicode(f"agent {name!r}'s system prompt", system)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise WorkflowError(f"agent {name!r}: max_tokens must be an int >= 1, got {max_tokens!r}")
    if not _is_number(temperature) or temperature < 0:
        raise WorkflowError(f"agent {name!r}: temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise WorkflowError(f"agent {name!r}: top_p must be a number in (0, 1], got {top_p!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise WorkflowError(f"agent {name!r}: seed must be an int or None, got {seed!r}")
    for flag, value in (("unordered", unordered), ("ignore_eos", ignore_eos)):
        if not isinstance(value, bool):
            raise WorkflowError(f"agent {name!r}: {flag} must be true or false, got {value!r}")
