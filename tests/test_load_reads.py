"""What a loading rank reads and opens: with a process group rank 0 alone reads the head of the
step's ``manifest.json`` and the others get its bytes over the group (a failure there is every
rank's error, none waits forever), then each rank reads the entries of the tensors it loads;
each rank opens the files it reads once, not a walk of the path per file
(``docs/loading.md``)."""

from __future__ import annotations

import os

import multirank
import pytest
import torch

import ckptd
import ckptd.storage.local as local
import ckptd.storage.local_dirs as local_dirs
from ckptd.manifest import layout
from ckptd.storage.local import LocalStorage

STEP = 7
ROWS, COLS = 6, 9


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 1.5


def _saved_state(rank: int, world: int) -> dict[str, object]:
    rows = ROWS // world
    return {"w": ckptd.Shard(_full()[rank * rows:(rank + 1) * rows].clone(), (ROWS, COLS),
                             (rank * rows, 0)),
            "b": ckptd.Shard(torch.tensor([1.0, -2.0, 3.0]), (3,), (0,), replica=rank,
                             replicas=world),
            "note": "hello"}


class Counting(LocalStorage):
    """Counts what a load reads: the bytes of manifest.json (and their ranges), and the files
    read from."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.manifest_bytes = 0
        self.manifest_ranges: list[tuple[int, int]] = []
        self.read_from: set[str] = set()

    def read_bytes(self, path: str) -> bytes:
        out = super().read_bytes(path)
        self.read_from.add(path)
        if path.endswith(layout.MANIFEST):
            self.manifest_bytes += len(out)
        return out

    def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
        out = super().read_ranges(path, ranges)
        self.read_from.add(path)
        if path.endswith(layout.MANIFEST):
            self.manifest_bytes += sum(len(b) for b in out)
            self.manifest_ranges += list(ranges)
        return out

    def open_read(self, paths):  # type: ignore[no-untyped-def]
        self.read_from.update(paths)
        return _CountedSession(self, super().open_read(paths))


class _CountedSession:
    """A read session whose reads of manifest.json its storage counts."""

    def __init__(self, storage: Counting, inner) -> None:  # type: ignore[no-untyped-def]
        self.storage, self.inner = storage, inner
        self.sizes, self.fills_buffers = inner.sizes, inner.fills_buffers
        self.resident = inner.resident

    def _count(self, path: str, offset: int, length: int) -> None:
        if path.endswith(layout.MANIFEST):
            self.storage.manifest_bytes += length
            self.storage.manifest_ranges.append((offset, length))

    def read_into(self, path, offset, buf):  # type: ignore[no-untyped-def]
        self.inner.read_into(path, offset, buf)
        self._count(path, offset, len(buf))

    def read(self, path, offset, length):  # type: ignore[no-untyped-def]
        out = self.inner.read(path, offset, length)
        self._count(path, offset, length)
        return out

    def close(self) -> None:
        self.inner.close()


def _count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every open a LocalStorage makes (files and the directories of its walks), by name."""
    opened: list[str] = []
    for module, name in ((local, "open_at"), (local_dirs, "open_at"),
                         (local_dirs, "open_beneath")):
        real = getattr(module, name)

        def counted(path, *a, _real=real, **k):  # type: ignore[no-untyped-def]
            fd = _real(path, *a, **k)
            if fd is not None:
                opened.append(path)
            return fd

        monkeypatch.setattr(module, name, counted)
    return opened


def _head_bytes(root: str) -> int:
    """The length of the head of the step's manifest (its lead says it)."""
    with open(f"{root}/{layout.manifest_path(STEP)}", "rb") as f:
        raw = f.read()
    at = raw.index(b'"head":"') + len(b'"head":"')
    return int(raw[at:at + 16], 16)


def _save_and_load(rank: int, world: int, root: str, corrupt: str | None) -> dict[str, object]:
    with ckptd.Checkpointer(root, rank=rank, world_size=world) as ck:
        ck.save(_saved_state(rank, world), step=STEP)
    if corrupt is not None and rank == 0:  # one flipped byte in the manifest
        path = f"{root}/{layout.manifest_path(STEP)}"
        with open(path, "r+b") as f:
            raw = f.read()
            # in the tail: the last entry, "w"'s; in the head: a value
            at = len(raw) - 40 if corrupt == "entry" else raw.index(b'"note"') + 2
            f.seek(at)
            f.write(bytes([raw[at] ^ 0x55]))
    torch.distributed.barrier()
    cols = COLS // world  # a column slice: every rank reads from every rank's file
    dest = {"w": ckptd.Shard(torch.zeros(ROWS, cols), (ROWS, COLS), (0, rank * cols)),
            "b": torch.zeros(3), "note": ""}
    storage = Counting(root)
    with pytest.MonkeyPatch.context() as mp:
        opened = _count_opens(mp)
        error = None
        try:
            with ckptd.Checkpointer(root, rank=rank, world_size=world, read_only=True,
                                    storage=storage) as ck:
                ck.load(dest, step=STEP)
        except ckptd.CkptdError as e:
            error = f"{type(e).__name__}: {e}"
    return {"manifest_bytes": storage.manifest_bytes, "read_from": sorted(storage.read_from),
            "manifest_ranges": storage.manifest_ranges, "head": _head_bytes(root),
            "size": os.path.getsize(f"{root}/{layout.manifest_path(STEP)}"),
            "opened": opened, "error": error,
            "exact": torch.equal(dest["w"].local, _full()[:, rank * cols:(rank + 1) * cols])
            and torch.equal(dest["b"], torch.tensor([1.0, -2.0, 3.0]))
            and dest["note"] == "hello"}


def test_rank_0_alone_reads_the_head_and_each_rank_its_entries_and_loads_bit_exact(tmp_path):
    out = multirank.run(_save_and_load, 3, str(tmp_path / "root"), None, timeout=180)
    assert [o["error"] for o in out] == [None] * 3
    assert all(o["exact"] for o in out)
    head = out[0]["head"]
    assert out[0]["manifest_ranges"][0] == (0, min(512, head))  # the lead says where it ends
    assert sum(n for o, n in out[0]["manifest_ranges"] if o < head) == head
    for o in out[1:]:  # the head came over the group; the entries from the file, after it
        assert o["manifest_ranges"] and all(at >= head for at, _ in o["manifest_ranges"])
    # each reads the entries of "b" and "w", next to each other: one range, the tail but its
    # ',"tensors":{"b":' and '}}'
    entries = (head + 16, out[1]["size"] - head - 18)
    assert [o["manifest_ranges"] for o in out[1:]] == [[entries]] * 2


def test_a_loading_rank_opens_the_files_it_reads_and_two_more(tmp_path):
    out = multirank.run(_save_and_load, 3, str(tmp_path / "root"), None, timeout=180)
    for rank, o in enumerate(out):
        data = [p for p in o["read_from"] if "/data/" in p]
        assert len(data) >= 3, (rank, o["read_from"])  # a column of every rank's rows
        assert len(o["opened"]) <= len(o["read_from"]) + 2, (rank, o["read_from"], o["opened"])


@pytest.mark.parametrize("damaged, reason", [
    ("head", "the manifest's head does not match its digest"),
    ("entry", "w: the manifest's entry for this tensor does not match its digest")])
def test_a_corrupt_manifest_is_every_ranks_one_line_error(tmp_path, damaged, reason):
    out = multirank.run(_save_and_load, 3, str(tmp_path / "root"), damaged, timeout=180)
    errors = [o["error"] for o in out]
    assert errors[0] is not None and errors[0].startswith("CorruptCheckpoint: ")
    assert f"{layout.manifest_path(STEP)}: {reason} (damaged or edited)" in errors[0]
    assert "\n" not in errors[0]
    assert errors == [errors[0]] * 3
    if damaged == "head":  # refused before any entry is read
        assert [o["manifest_bytes"] for o in out[1:]] == [0, 0]
    assert not any(o["exact"] for o in out)  # nothing was loaded


def _rank_0_cannot_read(rank: int, world: int, root: str) -> str | None:
    with ckptd.Checkpointer(root, rank=rank, world_size=world) as ck:
        ck.save(_saved_state(rank, world), step=STEP)
    torch.distributed.barrier()
    storage = Counting(root) if rank else Missing(root)
    dest = {"w": ckptd.Shard(torch.zeros(ROWS // world, COLS), (ROWS, COLS),
                             (rank * ROWS // world, 0)), "b": torch.zeros(3), "note": ""}
    try:
        with ckptd.Checkpointer(root, rank=rank, world_size=world, read_only=True,
                                storage=storage) as ck:
            ck.load(dest, step=STEP)
    except ckptd.CkptdError as e:
        return f"{type(e).__name__}: {e}"
    return None


class Missing(Counting):
    """Finds the manifest gone (another node's stale view, say)."""

    def open_read(self, paths):  # type: ignore[no-untyped-def]
        if any(p.endswith(layout.MANIFEST) for p in paths):
            raise FileNotFoundError(2, "no such file", paths[0])
        return super().open_read(paths)

    def read_bytes(self, path: str) -> bytes:
        if path.endswith(layout.MANIFEST):
            raise FileNotFoundError(2, "no such file", path)
        return super().read_bytes(path)


def test_rank_0_failing_to_read_the_manifest_fails_every_rank_alike(tmp_path):
    out = multirank.run(_rank_0_cannot_read, 3, str(tmp_path / "root"), timeout=180)
    assert out[0] is not None and out[0].startswith("CheckpointNotFound: ")
    assert out == [out[0]] * 3
