"""Operator arguments: random programs of `af.materialize / extend / fork / transfer / compose / evict /
free / pin / unpin / generate` on in-process tiny engines, with freed, evicted, other-model and
wrong-type refs and out-of-range arguments.

Two engines serve one model (so transfer has a destination), a third another model. After every
step each engine's sequences must be exactly those its hosts' resident refs hold; after the
program, closing the hosts must bring every pool back to zero used blocks.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from aaflow.benchmarks.fuzz.harness import Surface

JUNK = [None, "kv-1", 42, 1.5, b"kv", [], {}, object]
OPS = ["materialize", "extend", "fork", "transfer", "compose", "evict", "free", "pin", "unpin", "generate"]


def _mostly(valid, invalid):
    """`valid` three times in four, else `invalid` (bad input must be common, not the only input)."""
    from hypothesis import strategies as st

    return st.integers(0, 3).flatmap(lambda i: invalid if i == 3 else valid)


def _strategies():
    from hypothesis import strategies as st

    junk = st.sampled_from(JUNK)
    ref = _mostly(st.integers(0, 30), st.tuples(st.just("junk"), junk))  # an index into the refs made so far
    good_ids = st.lists(st.integers(0, 319), min_size=1, max_size=40)
    ids = st.lists(st.integers(-3, 330) | st.sampled_from([True, 2.0, "7"]), max_size=40)
    text = _mostly(st.text(min_size=1, max_size=40) | good_ids,
                   ids | st.integers(1, 700).map(lambda n: "x" * n)
                   | st.sampled_from(["\ud800", "", " ", "\x00", "é🙂"]) | junk)
    count = _mostly(st.integers(1, 4), st.integers(-2, 0) | junk)
    number = _mostly(st.floats(0, 1), st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3) | junk)
    sampling = st.dictionaries(
        st.sampled_from(["temperature", "top_p", "seed", "stop", "ignore_eos", "bogus"]),
        _mostly(st.floats(0.1, 1) | st.integers(0, 9), number | st.text(max_size=3) | st.booleans()), max_size=3)
    max_new = _mostly(st.integers(1, 6), st.integers(-2, 0) | st.sampled_from([10**9]) | junk)
    args = {
        "materialize": st.tuples(_mostly(st.integers(0, 5), st.integers(6, 9)), text, st.booleans(),
                                 _mostly(st.none() | st.integers(1, 16), count)),
        "extend": st.tuples(ref, text, st.none() | count),
        "fork": st.tuples(ref, count),
        "transfer": st.tuples(ref, _mostly(st.integers(0, 5), st.integers(6, 9))),
        "compose": st.tuples(st.lists(ref, max_size=3),
                             _mostly(st.sampled_from(["exact", "rerotate", "blend"]), st.just("x") | junk),
                             number, st.none() | good_ids | ids),
        "evict": st.tuples(ref, _mostly(st.none() | st.booleans(), junk)),
        "free": st.tuples(ref),
        "pin": st.tuples(ref, st.none() | number),
        "unpin": st.tuples(ref),
        "generate": st.tuples(ref, text, max_new, sampling, st.booleans()),
    }
    step = st.sampled_from(OPS).flatmap(lambda op: st.tuples(st.just(op), args[op]))
    budget = st.none() | st.integers(0, 40_000)
    return st.tuples(budget, good_ids, st.lists(step, min_size=1, max_size=8))


class OperatorArguments(Surface):
    """Programs of operator calls; see the module doc for the invariants."""

    name = "operator_arguments"

    def __init__(self, model_dir: Path, other_model_dir: Path) -> None:
        self.dirs = (model_dir, model_dir, other_model_dir)
        self._violations: list[str] = []
        self._stale = None  # a ref of a finished case: its host is closed

    def __enter__(self) -> "OperatorArguments":
        from aaflow.engine import Engine

        super().__enter__()
        self.engines = [Engine.from_pretrained(d, dtype="float32", num_blocks=48) for d in self.dirs]
        self.spill_dir = Path(tempfile.mkdtemp(prefix="aaflow-fuzz-spill-"))
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.spill_dir, ignore_errors=True)

    def cases(self):
        return _strategies()

    def run(self, case) -> None:
        import aaflow as af
        from aaflow.operators import EvictionPolicy, KVHost

        budget, context, steps = case
        self.hosts = [KVHost(e, name=f"fuzz-{i}", policy=EvictionPolicy(budget if i == 0 else None),
                             spill_dir=self.spill_dir if i == 1 else None) for i, e in enumerate(self.engines)]
        self._violations = []
        refs = [self._stale] if self._stale is not None else []  # a freed ref from the case before
        refs += [af.materialize(self.hosts[0], context), af.materialize(self.hosts[2], context)]
        for op, args in steps:
            try:
                made = self._step(af, op, args, refs)
                self.steps[f"{op}: ok"] += 1
            except af.AAFlowError as exc:
                made = []
                self.steps[f"{op}: {type(exc).__name__}"] += 1
                if isinstance(exc, af.SequenceError):  # users never name sequences: an internal inconsistency
                    self._violations.append(f"{op}{args!r:.200} raised SequenceError: {exc}")
            finally:
                self._violations += self._check_sequences(f"after {op}{args!r:.200}")
            refs += made
            if self._violations:
                return

    def _pick(self, refs: list, choice):
        if isinstance(choice, tuple):
            return choice[1]
        return refs[choice % len(refs)] if refs else None

    def _target(self, index: int):
        """0-2: a host, 3-5: an engine (the `af.*` functions accept both); beyond: junk."""
        return (self.hosts + self.engines)[index] if index < 6 else JUNK[index % len(JUNK)]

    def _step(self, af, op: str, args: tuple, refs: list) -> list:
        if op == "materialize":
            target, text, lineage, chunk = args
            return [af.materialize(self._target(target), text, lineage=lineage, chunk_size=chunk)]
        if op == "extend":
            return [af.extend(self._pick(refs, args[0]), args[1], chunk_size=args[2])]
        if op == "fork":
            return list(af.fork(self._pick(refs, args[0]), args[1]))
        if op == "transfer":
            return [af.transfer(self._pick(refs, args[0]), self._target(args[1]))]
        if op == "compose":
            parts, mode, r, check = args
            return [af.compose(*[self._pick(refs, p) for p in parts], mode=mode, r=r, check=check)]
        if op == "evict":
            af.evict(self._pick(refs, args[0]), spill=args[1])
        elif op in ("free", "unpin"):
            getattr(af, op)(self._pick(refs, args[0]))
        elif op == "pin":
            af.pin(self._pick(refs, args[0]), args[1])
        elif op == "generate":
            kv, prompt, max_new, sampling, keep = args
            out = af.generate(self._pick(refs, kv), prompt, max_new, keep_kv=keep, **sampling)
            return [out.kv] if keep else []
        return []

    def _all_hosts(self, index: int) -> list:
        engine = self.engines[index]
        return [self.hosts[index]] + ([engine.kv_host] if hasattr(engine, "kv_host") else [])

    def _check_sequences(self, where: str) -> list[str]:
        """Each engine's sequences are exactly its hosts' resident refs' sequences (nothing orphaned)."""
        problems = []
        for i, engine in enumerate(self.engines):
            held = {e.seq_id for h in self._all_hosts(i) for e in h._entries.values() if e.seq_id is not None}
            orphans = set(engine.runner.sequences) - held
            missing = held - set(engine.runner.sequences)
            if orphans or missing:
                problems.append(f"engine {i} {where}: orphaned sequences {sorted(orphans)}, "
                                f"refs without their sequence {sorted(missing)}")
        return problems

    def invariants(self) -> list[str]:
        problems = list(self._violations)
        for i, engine in enumerate(self.engines):
            live = [r for h in self._all_hosts(i) for r in h.refs()]
            if live:  # freed by the close below: a stale ref for the next case
                self._stale = live[0]
            for host in self._all_hosts(i):
                host.close()
            used = engine.stats().used
            if used or engine.runner.sequences:
                problems.append(f"engine {i}: {used} blocks used after every ref was freed "
                                f"(sequences {sorted(engine.runner.sequences)})")
                for seq in list(engine.runner.sequences):
                    engine.free(seq)
        return problems
