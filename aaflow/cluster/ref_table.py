"""The KVRefs a built-in replica holds, addressed by id, and the records it hands out for them."""

from __future__ import annotations

from aaflow.common.errors import KVRefFreedError
from aaflow.operators import KVRef
from aaflow.runtime.replies import RefRecord


class RefTable:
    """KVRefs by id on replica `owner`."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.refs: dict[str, KVRef] = {}

    def __len__(self) -> int:
        return len(self.refs)

    def add(self, ref: KVRef, computed: int = 0) -> RefRecord:
        """Keep `ref` (again, if it is kept already) and return its record."""
        self.refs[ref.id] = ref
        return RefRecord(ref.id, self.owner, ref.fingerprint, ref.token_ids, ref.nbytes, ref.fidelity, computed)

    def get(self, ref_id: str) -> KVRef:
        """The ref; KVRefFreedError when it was freed or never lived here."""
        if ref_id not in self.refs:
            raise KVRefFreedError(f"no KVRef {ref_id} on replica {self.owner}: it was freed or never lived here")
        return self.refs[ref_id]

    def pop(self, ref_id: str) -> KVRef:
        """Forget the ref and return it (KVRefFreedError as `get`)."""
        ref = self.get(ref_id)
        del self.refs[ref_id]
        return ref

    def clear(self) -> None:
        self.refs.clear()
