"""The notification side of a `nixl` endpoint: a poller thread that answers peers and progresses
the agent.

Progress: with UCX shared-memory transports (`posix`, `sysv`) a READ is emulated in
software over active messages, so the source must keep progressing its worker for the READ to
advance. NIXL's own progress thread competes for the cores of a small machine (what it gave on
two cores: docs/RESULTS-history.md), so each endpoint runs a Python thread that polls
notifications: it spins while it holds leases and otherwise sleeps between polls: 50 us for 50 ms
after the last message, then backing off to `idle_poll_s` (5 ms: an idle endpoint then costs a
small fraction of a core; polling more often cost markedly more). A BEGIN is answered within that
period and turns spinning on; back-to-back fetches find the poller awake.
"""

from __future__ import annotations

import logging
import struct
import time

from aaflow.common.errors import KVTransferError

from ._leases import ABORT, ACK, BEGIN, DONE, GONE, LEASE_GRACE_S, OK, Message

log = logging.getLogger(__name__)
ACK_PAYLOAD = struct.Struct("<QQ")  # address (of a scatter list: its digest), nbytes of the leased exposure
_MIN_POLL_S = 5e-5  # poll period while active; it doubles up to `idle_poll_s` when idle
_LINGER_S = 0.05  # how long after the last message polling stays at _MIN_POLL_S


class NotificationPoller:
    """Mixin of `NixlTransport` (uses its agent, leases, acks, peers, spans and poll settings)."""

    def _pump(self) -> bool:
        """Progress the agent once and handle every notification that arrived (True if any)."""
        messages = self._agent.notifications()
        for agent, message in messages:
            try:
                self._on_message(agent, message)
            except Exception:  # a bad peer message must not break our own fetch
                log.exception("nixl: cannot handle %s from %s", message.kind, agent)
        return bool(messages)

    def _on_message(self, agent: str, message: Message) -> None:
        if message.kind == ACK:
            self._acks[message.token] = message
        elif message.kind == DONE:
            run_cleanups(self._leases.end(message.handle_id, message.token))
        elif message.kind == ABORT:  # the reader gave up; its READ may still be draining
            run_cleanups(self._leases.end(message.handle_id, message.token, grace_s=LEASE_GRACE_S))
        elif message.kind == BEGIN:
            if agent not in self._peers:
                self._agent.load(message.payload)  # the reader's connection info
                self._peers.add(agent)
            lease_s = min(message.status, self._max_lease_s)
            tensor = self._leases.acquire(message.handle_id, message.token, lease_s)
            status, payload = GONE, ACK_PAYLOAD.pack(0, 0)
            if tensor is not None:
                span = self._spans.get(message.handle_id, (tensor.data_ptr(), tensor.nbytes))
                status, payload = OK, ACK_PAYLOAD.pack(*span)
            try:
                self._agent.notify(
                    agent, Message(ACK, status, message.handle_id, message.token, payload)
                )
            except KVTransferError:
                log.warning("nixl: could not answer agent %s", agent, exc_info=True)
                run_cleanups(self._leases.end(message.handle_id, message.token))

    def _poll_loop(self) -> None:
        """Spin while a peer holds a lease; otherwise poll with a backoff up to `idle_poll_s`."""
        next_expiry = last_active = time.monotonic()
        sleep_s = _MIN_POLL_S
        while not self._stop.is_set():
            try:
                if self._pump() or self._leases.has_leases():
                    last_active, sleep_s = time.monotonic(), _MIN_POLL_S
                if time.monotonic() >= next_expiry:
                    run_cleanups(self._leases.expire())
                    next_expiry = time.monotonic() + 1.0
            except Exception:  # keep serving other peers; one bad message must not stop us
                log.exception("nixl: notification poller error")
                self._stop.wait(0.1)
            if self._leases.has_leases():
                continue  # a peer is reading: keep progressing
            self._stop.wait(sleep_s)
            if time.monotonic() - last_active > _LINGER_S:
                sleep_s = min(2 * sleep_s, self._idle_poll_s)


def run_cleanups(cleanups: list) -> None:
    for cleanup in cleanups:
        cleanup()
