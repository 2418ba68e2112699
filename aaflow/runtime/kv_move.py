"""Moving a ref's KV between replicas: expose on the source, receive on the destination, release
on the source, whatever the receive did. The one place this protocol is written, driven two ways:

- `move_now(call, ...)`: call by call, waiting for each answer (`af.transfer`);
- `MoveInFlight` (`start_move`): through the scheduler's call queues, each call launched when the
  previous one answers (prefix sharing, the DSL's transfer and fork nodes on another replica).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from aaflow.runtime.call_queues import Timed
from aaflow.runtime.calls import ExposeCall, ReceiveCall, ReleaseCall
from aaflow.runtime.replies import Exposure, Received


def move_now(call: Callable, source, dest, ref_id: str, transport: str) -> Received:
    """Move ref `ref_id` from `source` to `dest` with `call(replica, call)` (which waits): the
    destination's answer. The exposure is released if the receive raised."""
    exposure = call(source, ExposeCall(ref_id, transport))
    try:
        return call(dest, ReceiveCall(exposure.handle, exposure.shape, exposure.record, transport))
    finally:
        call(source, ReleaseCall(exposure.handle, transport))


@dataclass
class MoveInFlight:
    """A move through the call queues: `handle` set once the source exposed the ref (until then a
    failure has nothing to release); `ran_s` the expose's and the receive's own seconds (their
    time queued behind other calls not counted)."""

    source: str
    dest: str
    transport: str
    handle: object = field(default=None)
    ran_s: float = 0.0

    def release_call(self) -> ReleaseCall | None:
        """The call that ends the source's exposure (None if it has not exposed yet)."""
        return None if self.handle is None else ReleaseCall(self.handle, self.transport)


def start_move(queues, source: str, dest: str, ref_id: str, transport: str,
               received: Callable[[Received], None]) -> MoveInFlight:
    """Queue the move of ref `ref_id` from `source` to `dest`; `received(answer)` gets the
    destination's answer after the source's release is queued. Answers the move,
    whose `release_call()` a caller uses when the move fails on the way."""
    move = MoveInFlight(source, dest, transport)

    def exposed(out: Exposure) -> None:
        move.handle, move.ran_s = out.handle, expose.ran_s()
        receive = Timed(lambda answer: done(answer, receive), queues.now)
        queues.call(dest, ReceiveCall(out.handle, out.shape, out.record, transport), then=receive)

    def done(answer: Received, receive: Timed) -> None:
        move.ran_s += receive.ran_s()
        queues.call(source, ReleaseCall(move.handle, transport))
        move.handle = None  # released
        received(answer)

    expose = Timed(exposed, queues.now)
    queues.call(source, ExposeCall(ref_id, transport), then=expose)
    return move
