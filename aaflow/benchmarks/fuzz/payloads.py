"""KV import payloads and received descriptors: what a peer or the disk hands a replica.

Four kinds of case, against in-process replicas (`ModelReplica`, the class a Ray actor wraps) of
a tiny model and one of another model:
- `import`: `engine.import_kv` of a real export with its fingerprint, token ids or tensor damaged
  (other model, junk, wrong shape / dtype, non-contiguous, out-of-vocabulary ids);
- `spill`: a spilled KV file with its bytes truncated, flipped or replaced, reloaded;
- `control`: random or damaged transport control messages and sealed peer blobs, parsed;
- `descriptor`: `receive` of a real exposure over the `local` transport with the handle, the
  `KVShape` or the ref record forged (sizes, dims, dtype names, token ids, types).
After every case the destination pool holds exactly what it held before (a refused payload
allocates nothing), and a successful receive allocated no more than the ref's declared size.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from aaflow.benchmarks.fuzz.harness import Surface

JUNK = [None, "x", -1, 2**40, 1.5, b"\x00", (), [1, 2]]


def _strategies():
    from hypothesis import strategies as st

    junk = st.sampled_from(JUNK)
    tokens = st.lists(st.integers(0, 319), min_size=1, max_size=48)
    ids = st.lists(st.integers(-2, 400) | st.sampled_from([True, 1.0]), max_size=64) | junk
    dims = st.lists(st.integers(-1, 70), min_size=0, max_size=6).map(tuple) | junk
    dtypes = st.sampled_from(["float32", "bfloat16", "float16", "int8", "complex64", "nope", ""]) | junk
    fingerprint = st.sampled_from(["same", "other", "", "0" * 64]) | junk
    field = st.sampled_from(["fingerprint", "token_ids", "kv", "none", "whole"])  # whole: `ids` given as the export
    tensor = st.sampled_from(["same", "shape", "dtype", "noncontig", "empty", "bytes", "numpy"])
    imports = st.tuples(st.just("import"), tokens, field, fingerprint, ids, tensor, st.integers(0, 4))
    spill = st.tuples(st.just("spill"), tokens, st.sampled_from(["truncate", "flip", "random", "meta", "none"]),
                      st.floats(0, 1), st.binary(max_size=64))
    control = st.tuples(st.just("control"), st.binary(max_size=80), st.integers(0, 40), st.binary(max_size=4))
    handle_edit = st.fixed_dictionaries({}, optional={"nbytes": st.integers(-1, 2**34) | junk,
                                                      "shape": dims, "dtype": dtypes, "handle_id": st.text(max_size=8),
                                                      "pid": st.integers(0, 2**22), "transport": st.text(max_size=5)})
    shape_edit = st.fixed_dictionaries({}, optional={"fingerprint": fingerprint, "shape": dims, "dtype": dtypes})
    record_edit = st.fixed_dictionaries({}, optional={"token_ids": ids.map(lambda x: tuple(x) if isinstance(
        x, list) else x) | st.integers(1, 10**6).map(lambda n: (1,) * n), "nbytes": st.integers(-1, 2**40) | junk,
        "fidelity": st.just("approx") | junk, "id": junk})
    descriptor = st.tuples(st.just("descriptor"), tokens, handle_edit, shape_edit, record_edit,
                           st.sampled_from(["handle", "shape", "record", "junk_handle", "released"]))
    return st.one_of(imports, spill, control, descriptor)


class KVPayloads(Surface):
    """Damaged payloads and descriptors offered to replicas (see the module doc)."""

    name = "kv_payloads"

    def __init__(self, model_dir: Path, other_model_dir: Path) -> None:
        self.model_dir, self.other_model_dir = model_dir, other_model_dir

    def __enter__(self) -> "KVPayloads":
        from aaflow.cluster.replica import ModelReplica

        super().__enter__()
        self.src = ModelReplica("fuzz-src", str(self.model_dir), dtype="float32", num_blocks=48)
        self.dst = ModelReplica("fuzz-dst", str(self.model_dir), dtype="float32", num_blocks=48)
        self.other = ModelReplica("fuzz-other", str(self.other_model_dir), dtype="float32", num_blocks=8)
        self.dir = Path(tempfile.mkdtemp(prefix="aaflow-fuzz-kv-"))
        return self

    def __exit__(self, *exc) -> None:
        for replica in (self.src, self.dst, self.other):
            replica.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def cases(self):
        return _strategies()

    def run(self, case) -> None:
        self._before = (self.dst.engine.stats().used, set(self.dst.engine.runner.sequences), len(self.dst.refs))
        self._allocated_ok = None
        from aaflow.common.errors import AAFlowError

        try:
            getattr(self, f"_{case[0]}")(*case[1:])
        except AAFlowError as exc:
            self.steps[f"{case[0]}: {type(exc).__name__}"] += 1
            raise
        self.steps[f"{case[0]}: ok"] += 1

    # --- cases ----------------------------------------------------------------------------
    def _import(self, tokens, field, fingerprint, ids, tensor, axis) -> None:
        import torch

        from aaflow.operators import KVPayload

        export = self._export(tokens)
        fp = self._fingerprint(fingerprint, export.fingerprint)
        kv = export.kv
        if tensor == "shape":
            kv = kv.narrow(axis, 0, max(0, kv.shape[axis] - 1)) if kv.shape[axis] > 1 else kv.unsqueeze(0)
        elif tensor != "same":
            kv = {"dtype": kv.to(torch.float16), "noncontig": kv.transpose(3, 4), "empty": kv[:, :, :0],
                  "bytes": kv.numpy().tobytes(), "numpy": kv.numpy()}[tensor]
        payload = ids if field == "whole" else KVPayload(
            fp if field == "fingerprint" else export.fingerprint, ids if field == "token_ids" else export.token_ids,
            kv if field == "kv" else export.kv)
        self._import_and_free(payload)

    def _spill(self, tokens, damage, where, data) -> None:
        from aaflow.operators.spill import load_spilled, spill_export

        path = spill_export(self._export(tokens), self.dir / "kv.safetensors")
        raw = path.read_bytes()
        at = int(where * len(raw))
        raw = {"truncate": raw[:at], "flip": raw[:at] + bytes([raw[at - 1] ^ 0xFF if at else 0]) + raw[at + 1:],
               "random": data, "meta": raw.replace(b"token_ids", b"token_idz"), "none": raw}[damage]
        path.write_bytes(raw)
        self._import_and_free(load_spilled(path, self.dst.engine.fingerprint))

    def _control(self, data, cut, tail) -> None:
        from aaflow.cluster.transports._leases import BEGIN, Message, seal, unseal

        valid = Message(BEGIN, 30, "ab" * 16, 7, data).encode()
        for blob in (data, valid[:cut] + tail, valid):
            message = Message.decode(blob)
            assert message is None or isinstance(message, Message)
            assert unseal(blob) in (None, blob[12:])
            damaged = seal(data)[:cut] + tail + seal(data)[cut:]
            assert unseal(damaged) in (None, data)

    def _descriptor(self, tokens, handle_edit, shape_edit, record_edit, which) -> None:
        record = self.src.materialize(tokens)
        exposure = self.src.expose(record.id, "local")
        handle, shape, record = exposure.handle, exposure.shape, exposure.record
        exposed, ref_id = handle, record.id
        try:
            if which == "released":
                self.src.release(handle, "local")
            elif which == "junk_handle":
                handle = dataclasses.replace(shape, fingerprint=handle.handle_id)  # a shape where a handle goes
            handle = _replace(handle, handle_edit if which == "handle" else {})
            if which == "shape":
                shape = _replace(shape, {k: self._fingerprint(v, shape.fingerprint) if k == "fingerprint" else v
                                         for k, v in shape_edit.items()})
            if which == "record":
                edit = dict(record_edit)
                if edit.get("fidelity") == "approx":
                    from aaflow.operators import FidelityReport

                    edit["fidelity"] = FidelityReport("rerotate", total_tokens=len(record.token_ids))
                record = _replace(record, edit)
            received = self.dst.receive(handle, shape, record, "local", timeout_s=5.0).record
            self._allocated_ok = (received.nbytes <= record.nbytes, record.nbytes)
            self.dst.free(received.id)
        finally:
            self.src.release(exposed, "local")
            self.src.free(ref_id)

    # --- helpers --------------------------------------------------------------------------
    def _fingerprint(self, choice, same: str):
        """"same" / "other" name the real fingerprints; any other choice is sent as it is."""
        return same if choice == "same" else self.other.engine.fingerprint if choice == "other" else choice

    def _export(self, tokens):
        seq = self.src.engine.new_sequence()
        try:
            self.src.engine.prefill(seq, tokens)
            return self.src.engine.export_kv(seq)
        finally:
            self.src.engine.free(seq)

    def _import_and_free(self, payload) -> None:
        seq = self.dst.engine.import_kv(payload)
        tokens = len(payload.token_ids)
        self._allocated_ok = (len(self.dst.engine.sequence_tokens(seq)) == tokens, tokens)
        self.dst.engine.free(seq)

    def invariants(self) -> list[str]:
        problems = []
        after = (self.dst.engine.stats().used, set(self.dst.engine.runner.sequences), len(self.dst.refs))
        if after != self._before:
            problems.append(f"destination pool changed: (used blocks, sequences, refs) {self._before} -> {after}")
        if self._allocated_ok is not None and not self._allocated_ok[0]:
            problems.append(f"a receive allocated more than the declared {self._allocated_ok[1]}")
        for replica in (self.src, self.dst):
            for seq in list(replica.engine.runner.sequences):
                if seq not in {e.seq_id for e in replica.host._entries.values()}:
                    problems.append(f"{replica.name}: orphaned sequence {seq}")
                    replica.engine.free(seq)
        return problems


def _replace(obj, changes: dict):
    """A copy of a frozen dataclass with `changes` (junk values included, as a forger would send)."""
    if not changes:
        return obj
    clone = dataclasses.replace(obj)
    for key, value in changes.items():
        object.__setattr__(clone, key, value)
    return clone
