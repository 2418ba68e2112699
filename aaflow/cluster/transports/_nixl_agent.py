"""A NIXL agent made safe to share between threads, with only the calls `nixl.py` needs, and the
handle that names one of its registrations to a peer (`NixlHandle`).

Every call into the agent holds one lock (the agent is created without NIXL's own
locking, and a notification poller thread shares it with fetching threads). Opaque blobs
that go to peers are sealed (`_leases.seal`): NIXL would half-load a truncated metadata
blob and then refuse that peer's good metadata too.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from aaflow.common.errors import KVTransferError

from ._leases import Message, seal, unseal
from .base import TransferHandle, TransportUnavailableError


@dataclass(frozen=True)
class NixlHandle(TransferHandle):
    agent_name: str
    """The source's NIXL agent."""
    agent_metadata: bytes
    """Source's partial metadata for the registration holding the tensor, with connection
    info (sealed: checked before NIXL parses it)."""
    reg_id: str
    """Id of that registration (destinations load its metadata once)."""
    reg_range: tuple[int, int]
    """(address, nbytes) of that registration in the source process."""
    addr: int
    """Address of the tensor in the source process (of its first segment, for a scatter list)."""
    segments: tuple[tuple[int, int], ...] = ()
    """`expose_segments`' scatter list (address, nbytes) in the source; empty: `nbytes` at `addr`."""


@dataclass
class Region:
    """One registered DRAM range; `tensor` keeps its memory alive while registered."""

    reg_id: str
    addr: int
    nbytes: int
    tensor: torch.Tensor
    descs: object  # nixlRegDList
    metadata: bytes | None = None  # sealed partial metadata with connection info

    def contains(self, tensor: torch.Tensor) -> bool:
        addr = tensor.data_ptr()
        return self.addr <= addr and addr + tensor.nbytes <= self.addr + self.nbytes


class AgentHost:
    """One NIXL agent with a UCX backend, no progress thread and no listener."""

    def __init__(self, ucx_tls: str, net_devices: str, error_handling_mode: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config  # optional: nixl (aaflow[transports])
            from nixl._bindings import DRAM_SEG, nixlRegDList
        except ImportError as err:
            raise TransportUnavailableError(
                f"nixl: cannot import NIXL ({err}); pip install nixl==1.5.1"
            ) from err
        self.name = f"aaflow-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        with _ucx_env(UCX_TLS=ucx_tls, UCX_NET_DEVICES=net_devices):
            config = nixl_agent_config(
                enable_prog_thread=False, enable_listen_thread=False, backends=[]
            )
            self._agent = nixl_agent(self.name, config)
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling_mode})
        no_memory = nixlRegDList(DRAM_SEG)
        self.conn_metadata = seal(self._agent.get_partial_agent_metadata(no_memory, True))

    # -- memory --------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        with self._lock:
            descs = self._agent.register_memory(tensor)
        return Region(uuid.uuid4().hex, tensor.data_ptr(), tensor.nbytes, tensor, descs)

    def deregister(self, region: Region) -> None:
        with self._lock:
            self._agent.deregister_memory(region.descs)

    def metadata(self, region: Region) -> bytes:
        """Sealed partial metadata of `region`, with connection info (computed once)."""
        if region.metadata is None:
            with self._lock:
                region.metadata = seal(self._agent.get_partial_agent_metadata(region.descs, True))
        return region.metadata

    # -- peers and notifications ---------------------------------------------------------------

    def load(self, sealed_metadata: bytes, forget: str | None = None) -> str:
        """Load a peer's sealed metadata (first dropping all we hold about agent `forget`);
        returns the peer's agent name."""
        metadata = unseal(sealed_metadata)
        if metadata is None:
            raise KVTransferError("nixl: agent metadata is damaged (checksum mismatch)")
        try:
            with self._lock:
                if forget is not None:
                    self._agent.remove_remote_agent(forget)
                return _text(self._agent.add_remote_agent(metadata))
        except Exception as err:
            raise KVTransferError(f"nixl: cannot load agent metadata: {err!r}") from err

    def notify(self, agent: str, message: Message) -> None:
        try:
            with self._lock:
                self._agent.send_notif(agent, message.encode())
        except Exception as err:
            raise KVTransferError(f"nixl: cannot notify agent {agent!r}: {err!r}") from err

    def notifications(self) -> list[tuple[str, Message]]:
        """Progress the agent once; the control messages that arrived, in order per peer."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        found = []
        for agent, payloads in notifs.items():
            for data in payloads:
                message = Message.decode(data)
                if message is not None:
                    found.append((_text(agent), message))
        return found

    # -- transfers -----------------------------------------------------------------------------

    def start_read(
        self, local: list[tuple[int, int]], agent: str, remote: list[tuple[int, int]],
        notification: Message,
    ) -> tuple[object, str]:
        """Post one READ of `remote` pieces (address, nbytes) in `agent` into the `local` pieces of
        the same sizes, pairwise: (xfer, state)."""
        with self._lock:
            local_descs = self._agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
            remote_descs = self._agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
            xfer = self._agent.initialize_xfer(
                "READ", local_descs, remote_descs, agent, notification.encode()
            )
            return xfer, self._agent.transfer(xfer)

    def state(self, xfer: object) -> str:
        """ "DONE", "PROC" or "ERR" (progresses the agent)."""
        with self._lock:
            return self._agent.check_xfer_state(xfer)

    def release_xfer(self, xfer: object) -> None:
        with self._lock:
            xfer.release()

    def close(self, peers: set[str]) -> None:
        with self._lock:
            for agent in peers:
                try:
                    self._agent.remove_remote_agent(agent)
                except Exception:  # already gone
                    pass
            self._agent = None


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


@contextmanager
def _ucx_env(**settings: str) -> Iterator[None]:
    """Set UCX variables while NIXL creates its UCX context (UCX reads them only then)."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
