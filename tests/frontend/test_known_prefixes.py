"""The endpoint's memory of prefixes shared across workflows (aaflow/serving/known_prefixes.py):
the longest remembered prefix a prompt begins with, per model, bounded and forgotten when idle."""

from __future__ import annotations

from aaflow.serving import known_prefixes
from aaflow.serving.known_prefixes import MIN_SHARED_TOKENS, PER_START, KnownPrefixes

HEADER = 3


def _prompt(*parts: range) -> tuple[int, ...]:
    return tuple(i for part in parts for i in part)


def test_the_longest_prefix_a_prompt_begins_with_short_of_its_last_token():
    known = KnownPrefixes()
    short = _prompt(range(HEADER + MIN_SHARED_TOKENS))
    long = _prompt(range(HEADER + 3 * MIN_SHARED_TOKENS))
    known.remember("m", short, HEADER)
    known.remember("m", long, HEADER)
    known.remember("m", _prompt(range(HEADER + MIN_SHARED_TOKENS - 1)), HEADER)  # under a block past the header
    assert known.longest("m", _prompt(range(HEADER + 4 * MIN_SHARED_TOKENS)), HEADER) == len(long)
    assert known.longest("m", long, HEADER) == len(short)  # something of its own must follow
    assert known.longest("m", _prompt(range(HEADER + 2 * MIN_SHARED_TOKENS), [7, 7]), HEADER) == len(short)
    assert known.longest("m", _prompt(range(1, HEADER + 4 * MIN_SHARED_TOKENS)), HEADER) == 0  # begins otherwise
    assert known.longest("other", _prompt(range(HEADER + 4 * MIN_SHARED_TOKENS)), HEADER) == 0
    assert known.longest("m", _prompt(range(HEADER + MIN_SHARED_TOKENS - 1), [9]), HEADER) == 0


def test_bounded_per_start_and_forgotten_when_idle(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(known_prefixes.time, "monotonic", lambda: clock[0])
    known = KnownPrefixes()
    start = range(HEADER + MIN_SHARED_TOKENS)
    for extra in range(PER_START + 1):  # each one token longer; the first is the least recently seen
        clock[0] += 1
        known.remember("m", _prompt(start, range(100, 100 + extra)), HEADER)
    assert known.longest("m", _prompt(start, [55]), HEADER) == 0  # the shortest was let go
    assert known.longest("m", _prompt(start, range(100, 102), [55]), HEADER) == len(start) + 2
    clock[0] += known_prefixes.FORGET_AFTER_S + 1
    assert known.longest("m", _prompt(start, range(100, 102), [55]), HEADER) == 0
