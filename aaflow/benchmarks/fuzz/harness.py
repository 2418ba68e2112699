"""The fuzz harness: run a surface's Hypothesis cases, classify every outcome, check invariants.

An outcome is `ok`, `typed` (an `AAFlowError`: bad input refused with a message), `untyped` (any
other exception: a bug), `hang` (the case ran past its time bound) or `invariant` (the case left the
surface's state broken: a leaked block, sequence or ref). Only the first two are allowed.
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from aaflow.common.errors import AAFlowError

MAX_RECORDED = 20  # failures kept verbatim per surface (the counts are always complete)


class CaseTimeout(BaseException):
    """Raised into a case that ran past its bound (a BaseException, so no `except Exception` swallows it)."""


class FuzzFailure(AssertionError):
    """A case ended untyped, hung or broke an invariant (raised in strict mode, so Hypothesis shrinks it)."""


class Surface(ABC):
    """One input surface: its cases, how to run one, and what must hold after each.

    Use as a context manager: `__enter__` builds what the cases run against (engines, hosts),
    `__exit__` frees it.
    """

    name: str
    time_limit_s: float = 20.0
    steps: Counter  # surfaces whose cases are programs count each step's outcome here ("op: outcome")

    def __enter__(self) -> "Surface":
        self.steps = Counter()
        return self

    def __exit__(self, *exc) -> None:
        return None

    @abstractmethod
    def cases(self):
        """A Hypothesis strategy of cases."""

    @abstractmethod
    def run(self, case) -> None:
        """Exercise one case; an `AAFlowError` escaping is a typed refusal, anything else a bug."""

    def invariants(self) -> list[str]:
        """Violations of the surface's invariants after a case (cleaning up for the next one)."""
        return []


@dataclass
class SurfaceReport:
    """Counts of outcomes over a surface's cases, with the first failures verbatim."""

    surface: str
    cases: int = 0
    ok: int = 0
    typed: Counter = field(default_factory=Counter)
    untyped: int = 0
    hangs: int = 0
    invariant_violations: int = 0
    failures: list[dict] = field(default_factory=list)
    steps: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    slowest_case_s: float = 0.0

    @property
    def failed(self) -> int:
        return self.untyped + self.hangs + self.invariant_violations

    def add(self, kind: str, seconds: float, detail: dict | None = None) -> None:
        self.cases += 1
        self.slowest_case_s = max(self.slowest_case_s, seconds)
        if kind == "ok":
            self.ok += 1
        elif kind.startswith("typed:"):
            self.typed[kind.removeprefix("typed:")] += 1
        else:
            counter = {"untyped": "untyped", "hang": "hangs", "invariant": "invariant_violations"}[kind]
            setattr(self, counter, getattr(self, counter) + 1)
            if len(self.failures) < MAX_RECORDED:
                self.failures.append({"kind": kind, **(detail or {})})

    def as_dict(self) -> dict:
        return {"cases": self.cases, "ok": self.ok, "typed_errors": dict(self.typed.most_common()),
                "untyped_errors": self.untyped, "hangs": self.hangs,
                "invariant_violations": self.invariant_violations, "seconds": round(self.seconds, 2),
                "slowest_case_s": round(self.slowest_case_s, 3), "steps": dict(sorted(self.steps.items())),
                "failures": self.failures}


@contextmanager
def time_bound(seconds: float):
    """Raise `CaseTimeout` into the block after `seconds` (SIGALRM; main thread only, else unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise CaseTimeout(f"case ran past its {seconds:.0f} s bound")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(surface: Surface, case) -> tuple[str, float, dict | None]:
    """(outcome kind, seconds, failure detail) of one case, invariants checked afterwards."""
    start = time.perf_counter()
    kind, detail = "ok", None
    try:
        with time_bound(surface.time_limit_s):
            surface.run(case)
    except AAFlowError as exc:
        kind = f"typed:{type(exc).__name__}"
    except CaseTimeout as exc:
        kind, detail = "hang", {"case": repr(case)[:2000], "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
        kind = "untyped"
        detail = {"case": repr(case)[:2000], "error": f"{type(exc).__name__}: {exc}"[:1000],
                  "traceback": traceback.format_exc(limit=-6)[-3000:]}
    seconds = time.perf_counter() - start
    violations = surface.invariants()
    if violations and (kind == "ok" or kind.startswith("typed:")):
        kind, detail = "invariant", {"case": repr(case)[:2000], "violations": violations[:10]}
    return kind, seconds, detail


def run_surface(surface: Surface, examples: int, seed: int = 0, strict: bool = False) -> SurfaceReport:
    """Run up to `examples` Hypothesis cases of an entered `surface`.

    Not strict (the benchmark): every outcome is counted. Strict (the test suite): the first failing
    case raises `FuzzFailure`, Hypothesis shrinks it and reports the smallest failing case.
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    report = SurfaceReport(surface.name)
    phases = [Phase.generate, Phase.shrink] if strict else [Phase.generate]

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=phases, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(surface.cases())
    def prop(case):
        kind, seconds, detail = run_case(surface, case)
        report.add(kind, seconds, detail)
        if strict and kind in ("untyped", "hang", "invariant"):
            raise FuzzFailure(f"{surface.name}: {kind} outcome: {detail}")

    start = time.perf_counter()
    prop()
    report.seconds = time.perf_counter() - start
    report.steps = Counter(getattr(surface, "steps", {}))
    return report
