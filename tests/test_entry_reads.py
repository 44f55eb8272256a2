"""A load reads the manifest's head and the entries of the tensors it loads, each checked
against its own digest (format 5, ``docs/format.md`` *Integrity*): damage it does not read does
not stop it, damage it reads is refused naming the manifest and the tensor before anything is
touched, and what a rank reads is bounded by its head and its entries; manifests of format 4
are read whole, as before."""

from __future__ import annotations

import json
import os
import shutil

import multirank
import pytest
import torch

import ckptd
from ckptd.cli import main as cli_main
from ckptd.manifest import layout as L
from ckptd.manifest.envelope import TENSORS_KEY
from ckptd.storage.local import LocalStorage

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
STEP = 3


def _path(root: str) -> str:
    return os.path.join(root, L.manifest_path(STEP))


def _raw(root: str) -> bytes:
    with open(_path(root), "rb") as f:
        return f.read()


def _head_len(raw: bytes) -> int:
    at = raw.index(b'"head":"') + len(b'"head":"')
    return int(raw[at:at + 16], 16)


def _entry(raw: bytes, name: str) -> tuple[int, int]:
    """Where ``name``'s entry is in the file: (first byte, length)."""
    head = _head_len(raw)
    item = json.loads(raw[:head] + b"}")["index"][name]
    return head + len(TENSORS_KEY) + item[2], item[3]


def _flip(root: str, at: int) -> None:
    with open(_path(root), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x04]))


def _save(root: str) -> None:
    with ckptd.Checkpointer(root) as c:
        c.save({"a": torch.arange(12.0).reshape(3, 4), "b": torch.full((5,), 2.5),
                "lr": 0.25}, step=STEP)


class _Reads(LocalStorage):
    """Records the byte ranges of manifest.json a load reads (through its read session)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.ranges: list[tuple[int, int]] = []

    def open_read(self, paths):  # type: ignore[no-untyped-def]
        session = super().open_read(paths)
        inner, ranges = session.read_into, self.ranges

        def read_into(path, offset, buf):  # type: ignore[no-untyped-def]
            inner(path, offset, buf)
            if path.endswith(L.MANIFEST):
                ranges.append((offset, len(buf)))
        session.read_into = read_into
        return session

    def read_bytes(self, path: str) -> bytes:
        out = super().read_bytes(path)
        if path.endswith(L.MANIFEST):
            self.ranges.append((0, len(out)))
        return out


def test_a_damaged_entry_the_load_does_not_read_does_not_stop_it(tmp_path, capsys):
    root = str(tmp_path / "r")
    _save(root)
    start, length = _entry(_raw(root), "b")
    _flip(root, start + length // 2)
    dest = {"a": torch.zeros(3, 4), "lr": 0.0}
    storage = _Reads(root)
    with ckptd.Checkpointer(root, read_only=True, storage=storage) as c:
        assert c.load(dest, step=STEP).tensors_decoded == 1
    assert torch.equal(dest["a"], torch.arange(12.0).reshape(3, 4)) and dest["lr"] == 0.25
    assert all(not (o < start + length and start < o + n) for o, n in storage.ranges)
    # the whole file's digest still says it is damaged
    assert cli_main(["verify", f"{root}/{L.step_dir(STEP)}"]) != 0
    assert "the manifest's digest does not match its bytes" in capsys.readouterr().err


def test_a_damaged_entry_the_load_reads_is_refused_naming_it_and_nothing_is_touched(tmp_path):
    root = str(tmp_path / "r")
    _save(root)
    start, length = _entry(_raw(root), "a")
    _flip(root, start + length // 2)
    dest = {"a": torch.full((3, 4), 7.0), "b": torch.full((5,), 7.0), "lr": 0.0}
    with ckptd.Checkpointer(root, read_only=True) as c:
        with pytest.raises(ckptd.CorruptCheckpoint) as e:
            c.load(dest, step=STEP)
    assert str(e.value) == (f"{_path(root)}: a: the manifest's entry for this tensor does not "
                            "match its digest (damaged or edited)")
    assert torch.equal(dest["a"], torch.full((3, 4), 7.0))
    assert torch.equal(dest["b"], torch.full((5,), 7.0)) and dest["lr"] == 0.0


@pytest.mark.parametrize("where", ["value", "index"])
def test_a_damaged_head_is_refused_before_any_entry_is_read(tmp_path, where):
    root = str(tmp_path / "r")
    _save(root)
    raw = _raw(root)
    # a value ("lr": 0.25 -> 0.65), or the start of "b"'s entry in the index
    at = raw.index(b"0.25") + 2 if where == "value" else raw.index(b'"b":["float32",[5],') + 20
    _flip(root, at)
    storage = _Reads(root)
    dest = {"a": torch.zeros(3, 4)}
    with ckptd.Checkpointer(root, read_only=True, storage=storage) as c:
        with pytest.raises(ckptd.CorruptCheckpoint) as e:
            c.load(dest, step=STEP)
    assert str(e.value) == (f"{_path(root)}: the manifest's head does not match its digest "
                            "(damaged or edited)")
    assert all(o < _head_len(raw) for o, _ in storage.ranges)  # no entry was read
    assert torch.equal(dest["a"], torch.zeros(3, 4))


@pytest.mark.parametrize("cut", [1, 40])
def test_a_truncated_manifest_is_refused_naming_it(tmp_path, cut):
    root = str(tmp_path / "r")
    _save(root)
    raw = _raw(root)
    with open(_path(root), "wb") as f:
        f.write(raw[:-cut])  # its last entry ("b"'s) is cut; "a"'s is whole
    dest = {"a": torch.zeros(3, 4)}
    with ckptd.Checkpointer(root, read_only=True) as c:
        with pytest.raises(ckptd.CorruptCheckpoint) as e:
            c.load(dest, step=STEP)
    assert str(e.value) == (f"{_path(root)}: {len(raw) - cut} bytes, its lead says {len(raw)} "
                            "(truncated or extended)")
    assert torch.equal(dest["a"], torch.zeros(3, 4))


def test_a_checkpoint_of_format_4_is_read_whole_and_loads_bit_exact(tmp_path, capsys):
    root = str(tmp_path / "format4")
    shutil.copytree(os.path.join(FIXTURES, "format4b"), root)
    step = 5
    with open(os.path.join(root, L.manifest_path(step)), "rb") as f:
        raw = f.read()
    assert b'"version":4,' in raw and b'"head_digest"' not in raw
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    for rank in (0, 1):  # saved on two ranks; each loads a column
        dest = {"model": {"w": ckptd.Shard(torch.zeros(8, 2), (8, 4), (0, 2 * rank)),
                          "b": torch.zeros(4), "h": torch.zeros(6, dtype=torch.bfloat16)},
                "optim": {"betas": (0.0, 0.0), "blob": b""}, "epoch": 0,
                "rng": ckptd.Local(torch.zeros(2))}
        storage = _Reads(root)
        with ckptd.Checkpointer(root, rank=rank, world_size=2, read_only=True,
                                storage=storage) as c:
            assert c.load(dest).step == step
        assert sum(n for _, n in storage.ranges) == len(raw)  # the whole file
        assert torch.equal(dest["model"]["w"].local, full[:, 2 * rank:2 * rank + 2])
        assert torch.equal(dest["model"]["b"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert torch.equal(dest["model"]["h"], torch.arange(6, dtype=torch.bfloat16))
        assert dest["optim"] == {"betas": (0.9, 0.95), "blob": b"\x00\x01"}
        assert dest["epoch"] == 3
        assert torch.equal(dest["rng"].value, torch.full((2,), float(rank)))
    assert cli_main(["verify", root]) == 0
    capsys.readouterr()


TENSORS, ROWS = 60, 8


def _many(rank: int, world: int) -> dict[str, object]:
    """Each rank saves its rows of TENSORS matrices."""
    rows = ROWS // world
    return {f"m{i:03d}": ckptd.Shard(torch.full((rows, 4), float(i * 100 + rank)), (ROWS, 4),
                                     (rank * rows, 0)) for i in range(TENSORS)}


def _load_a_few(rank: int, world: int, root: str) -> dict[str, object]:
    """Saved on ``world`` ranks; each rank then loads its rows of 5 of the tensors."""
    with ckptd.Checkpointer(root, rank=rank, world_size=world) as c:
        c.save(_many(rank, world), step=STEP)
    torch.distributed.barrier()
    names = [f"m{i:03d}" for i in range(rank, TENSORS, TENSORS // 5)]
    rows = ROWS // world
    dest = {n: ckptd.Shard(torch.zeros(rows, 4), (ROWS, 4), (rank * rows, 0)) for n in names}
    storage = _Reads(root)
    with ckptd.Checkpointer(root, rank=rank, world_size=world, read_only=True,
                            storage=storage) as c:
        decoded = c.load(dest, step=STEP).tensors_decoded
    raw = _raw(root)
    return {"ranges": storage.ranges, "head": _head_len(raw), "size": len(raw),
            "entries": [_entry(raw, n) for n in names], "decoded": decoded,
            "exact": all(torch.equal(dest[n].local, torch.full((rows, 4), float(
                int(n[1:]) * 100 + rank))) for n in names)}


def test_each_rank_reads_the_head_once_per_job_and_only_its_own_entries(tmp_path):
    out = multirank.run(_load_a_few, 2, str(tmp_path / "root"), timeout=180)
    assert all(o["exact"] for o in out) and [o["decoded"] for o in out] == [5, 5]
    head, size = out[0]["head"], out[0]["size"]
    gap = 1024  # ckptd.manifest.entries.ENTRY_GAP: entries that close are read as one range
    for rank, o in enumerate(out):
        entries = o["entries"]
        tail_reads = [(at, n) for at, n in o["ranges"] if at >= head]
        # every byte read past the head lies in a range that starts and ends at its entries
        starts, ends = {s for s, _ in entries}, {s + n for s, n in entries}
        assert all(at in starts and at + n in ends for at, n in tail_reads), (rank, tail_reads)
        assert sum(n for _, n in tail_reads) <= sum(n for _, n in entries) + 4 * gap
        head_read = sum(n for at, n in o["ranges"] if at < head)
        assert head_read == (head if rank == 0 else 0)  # rank 1 got it over the group
        assert sum(n for _, n in o["ranges"]) < size / 2, (rank, o["ranges"], size)
