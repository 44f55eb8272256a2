"""A load's view of the node agents' memory: what this node's agent holds (mapped, pinned for
the load) and, in a job with a secret, what every other node's agent holds (read over TCP from
its peer server), in front of the storage (``docs/agent.md``, *The memory tier*).

Who holds what is learnt with one gather over the job's process group: each node's first local
rank offers its agent's address and list of files. That gather is a collective, so whether it
happens is decided from what every rank shares: this Checkpointer uses agents, the job has a
secret, and the process group is this Checkpointer's world.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from ckptd.agent.client import AgentClient
from ckptd.agent.peer_wire import PeerReads, job_secret
from ckptd.errors import CkptdError
from ckptd.storage import Storage
from ckptd.storage.tiered import MemoryTier, Remote
from ckptd.world import dist_or_none, gather_object

log = logging.getLogger("ckptd")

# one entry per file another agent holds: (path, size, is a peer copy)
Offer = tuple[tuple[str, int] | None, list[tuple[str, int, bool]]]


@contextlib.contextmanager
def memory_tier(offload: AgentClient | None, storage: Storage, spec: dict[str, Any] | None,
                rank: int, world_size: int, *, agents: bool) -> Iterator[MemoryTier | None]:
    """For one load: the agents' memory in front of ``storage``, pinned until the load is done;
    None when no agent holds anything of the root. ``agents``: this Checkpointer uses node
    agents (the same on every rank); ``spec``: the root as the agents name it."""
    held, source = None, offload
    if source is not None and source.alive:
        try:
            held = source.held()
        except (CkptdError, OSError) as e:
            log.warning("ckptd: rank %d: the node agent's memory is not readable: %s", rank, e)
    files = held.files if held is not None else {}
    copies = held.copies if held is not None else set()
    reads: PeerReads | None = None
    remote: dict[str, Remote] = {}
    secret = job_secret()
    if agents and secret is not None and spec is not None and _collective(world_size):
        offer: Offer = (None, [])
        if held is not None and held.address is not None and _first_local_rank():
            offer = (held.address, [(p, len(m), p in copies) for p, m in files.items()])
        reads = PeerReads(secret, spec)
        remote = _elsewhere(gather_object(offer), files, held.address if held else None, reads)
    try:
        yield MemoryTier(storage, files, copies, remote) if files or remote else None
    finally:
        if reads is not None:
            reads.close()
        if held is not None and source is not None:
            try:
                source.unpin(held.lease)
            except CkptdError:  # a lost agent holds nothing any more
                pass


def _collective(world_size: int) -> bool:
    dist = dist_or_none()
    return dist is not None and dist.get_world_size() == world_size > 1


def _first_local_rank() -> bool:
    """One offer per node (torchrun's ``LOCAL_RANK``; every rank offers without it)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _elsewhere(offers: list[Offer], here: dict[str, memoryview],
               me: tuple[str, int] | None, reads: PeerReads) -> dict[str, Remote]:
    """The files other agents hold and this one does not: a node's own copy before a peer's."""
    out: dict[str, _RemoteFile] = {}
    for address, listing in offers:
        if address is None or tuple(address) == (tuple(me) if me else None):
            continue
        for path, size, is_copy in listing:
            if path in here or (path in out and (is_copy or not out[path].copy)):
                continue
            out[path] = _RemoteFile(reads, (str(address[0]), int(address[1])), path, int(size),
                                    bool(is_copy))
    return dict(out)


class _RemoteFile:
    def __init__(self, reads: PeerReads, address: tuple[str, int], path: str, size: int,
                 copy: bool) -> None:
        self.reads, self.address, self.path, self.size, self.copy = (reads, address, path,
                                                                     size, copy)

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.reads.read_into(self.address, self.path, offset, buf)

    def __repr__(self) -> str:
        return f"the agent at {self.address[0]}:{self.address[1]}"


__all__ = ["memory_tier"]
