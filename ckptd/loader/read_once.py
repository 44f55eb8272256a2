"""Read-once: a destination piece that several ranks need (the same box of a logical tensor:
replicated tensors, TP-replicated norms, DP replicas) is read by one of them and broadcast.

Off by default (``config.read_once``): measured on one node with a local disk, the page cache
already serves every reader after the first, and the broadcast costs more than it saves
(``docs/loading.md``). It is meant for shared filesystems and object stores, where each byte
read costs storage bandwidth that the ranks share.

Everything here runs in the caller's thread (collectives are never issued from background
threads). All ranks must call :func:`plan_sharing` together; the owners are chosen by a
deterministic greedy balance of bytes read per rank, so every rank computes the same plan.
The broadcast runs after the load's agreement step, from the owner's destination (by then it
holds verified data), in batches of at most ``unit_bytes`` counted against the load budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptd import config
from ckptd.loader.fetch import Buffers
from ckptd.sharding import Piece
from ckptd.storage import Storage

if TYPE_CHECKING:
    import torch

Key = tuple[str, tuple[int, ...], tuple[int, ...]]


def key_of(p: Piece) -> Key:
    return (p.name, p.box.offsets, p.box.sizes)


def enabled(storage: Storage) -> bool:
    mode = config.get().read_once
    if mode not in ("off", "on", "remote"):
        raise ValueError(f"read_once must be 'off', 'on' or 'remote', got {mode!r}")
    return mode == "on" or (mode == "remote" and "://" in storage.url)


@dataclass
class Item:
    key: Key
    nbytes: int
    owner: int
    holders: tuple[int, ...]


@dataclass
class Sharing:
    rank: int
    items: list[Item]
    pieces: dict[Key, list[Piece]] = field(default_factory=dict)  # this rank's, by key

    def to_read(self, pieces: list[Piece]) -> list[Piece]:
        """The pieces this rank reads itself: all but the shared ones another rank owns."""
        skip = {it.key for it in self.items if it.owner != self.rank}
        return [p for p in pieces if key_of(p) not in skip]

    def batches(self) -> list[tuple[int, list[Item]]]:
        cap = config.get().unit_bytes
        out: list[tuple[int, list[Item]]] = []
        for it in sorted(self.items, key=lambda it: (it.owner, it.key)):
            if out and out[-1][0] == it.owner and sum(x.nbytes for x in out[-1][1]) + it.nbytes \
                    <= cap:
                out[-1][1].append(it)
            else:
                out.append((it.owner, [it]))
        return out

    def broadcast(self, buffers: Buffers) -> int:
        """Send owned pieces, receive the others; returns the bytes this rank sent or used."""
        import torch
        import torch.distributed as dist

        moved = 0
        for owner, items in self.batches():
            n = sum(it.nbytes for it in items)
            buffers.reserve(n)
            buffers.count(n)
            try:
                buf = torch.empty(n, dtype=torch.uint8)
                with torch.no_grad():
                    if owner == self.rank:
                        self._pack(buf, items)
                    dist.broadcast(buf, src=owner)
                    if owner != self.rank:
                        moved += self._unpack(buf, items)
                    else:
                        moved += n
                del buf
            finally:
                buffers.uncount(n)
                buffers.release(n)
        return moved

    def _pack(self, buf: torch.Tensor, items: list[Item]) -> None:
        off = 0
        for it in items:
            p = self.pieces[it.key][0]
            buf[off : off + it.nbytes].view(p.tensor.dtype).view(p.box.sizes).copy_(p.tensor)
            off += it.nbytes

    def _unpack(self, buf: torch.Tensor, items: list[Item]) -> int:
        off = used = 0
        for it in items:
            for p in self.pieces.get(it.key, []):
                p.tensor.copy_(buf[off : off + it.nbytes].view(p.tensor.dtype).view(p.box.sizes))
                used += it.nbytes
            off += it.nbytes
        return used


def plan_sharing(pieces: list[Piece], storage: Storage) -> Sharing | None:
    """Who reads which shared piece (a collective: every rank calls it), or None when
    read-once is off or there is one rank."""
    import torch.distributed as dist

    if not enabled(storage) or dist.get_world_size() == 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: dict[Key, list[Piece]] = {}
    for p in pieces:
        if p.box.numel:
            mine.setdefault(key_of(p), []).append(p)
    offer = [(k, ps[0].box.numel * ps[0].view.element_size()) for k, ps in mine.items()]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, offer)
    holders: dict[Key, list[int]] = {}
    size: dict[Key, int] = {}
    for r, keys in enumerate(gathered):
        for k, n in keys:
            holders.setdefault(k, []).append(r)
            size[k] = n
    load = [0] * world
    for k, rs in holders.items():
        if len(rs) == 1:
            load[rs[0]] += size[k]
    items = []
    for k in sorted((k for k, rs in holders.items() if len(rs) > 1), key=lambda k: (-size[k], k)):
        owner = min(holders[k], key=lambda r: (load[r], r))
        load[owner] += size[k]
        items.append(Item(k, size[k], owner, tuple(holders[k])))
    return Sharing(rank, items, mine)
