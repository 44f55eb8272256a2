"""The manifest's head and lead: what listings and the step catalog read instead of the whole
manifest, for every format version, and how a damaged one is refused (docs/format.md, *The
lead*)."""

from __future__ import annotations

import os
import shutil
from unittest import mock

import pytest
import torch

import ckptd
from ckptd import catalog
from ckptd.cli import main as cli_main
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import encode
from ckptd.manifest import layout as L
from ckptd.manifest.encode import encode_doc
from ckptd.manifest.envelope import VERSION
from ckptd.manifest.lead import PREFIX_BYTES, lead
from ckptd.manifest.parse import decode, head
from ckptd.storage.local import LocalStorage

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _raw(root: str, step: int) -> bytes:
    with open(os.path.join(root, L.manifest_path(step)), "rb") as f:
        return f.read()


def _write(root: str, step: int, raw: bytes) -> None:
    with open(os.path.join(root, L.manifest_path(step)), "wb") as f:
        f.write(raw)


def _save(root: str, step: int = 4, **kw) -> str:  # type: ignore[no-untyped-def]
    with ckptd.Checkpointer(root, run_id="job", **kw) as c:
        c.save({"model": {"w": torch.ones(6, 2), "b": torch.zeros(3, dtype=torch.bfloat16)}},
               step=step, training={"lr": 0.1})
    return root


class _Reads(LocalStorage):
    """Records every read: (path, None) for a whole file, (path, ranges) for ranged reads."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, object]] = []

    def read_bytes(self, path: str) -> bytes:
        self.reads.append((path, None))
        return super().read_bytes(path)

    def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
        self.reads.append((path, list(ranges)))
        return super().read_ranges(path, ranges)


@pytest.mark.parametrize("fixture, step, world, generation, nbytes, tensors", [
    ("format1", 3, 1, 0, 16 * 4 + 4 * 4, {"model/b": ("float32", (4,)),
                                           "model/w": ("float32", (4, 4))}),
    ("format2", 7, 2, 1, 64 * 4 + 4 * 4, {"model/b": ("float32", (4,)),
                                           "model/w": ("float32", (8, 8))}),
])
def test_the_head_of_a_manifest_of_format_1_and_2(fixture, step, world, generation, nbytes,
                                                  tensors):
    root = os.path.join(FIXTURES, fixture)
    raw = _raw(root, step)
    got = head(raw, "m")
    whole = decode(raw, "m")
    assert (got.step, got.attempt, got.world_size, got.generation) == (
        step, f"{fixture}-000001", world, generation)
    assert {n: v for n, v in got.tensors.items() if n.startswith("model/")} == tensors
    assert got.tensors == {n: (t.dtype_name, t.shape) for n, t in whole.tensors.items()}
    assert got.nbytes == whole.nbytes >= nbytes
    assert got.created == whole.created and got.training == whole.training
    assert lead(raw[:PREFIX_BYTES], "m") is None  # no lead: the catalog reads the head
    assert [(c.step, c.generation) for c in catalog.committed(LocalStorage(root))] == [
        (step, generation)]


def test_the_head_and_the_lead_of_a_manifest_of_format_3(tmp_path):
    root = _save(str(tmp_path / "r"))
    raw = _raw(root, 4)
    got, whole = head(raw, "m"), decode(raw, "m")
    assert got.tensors == {"model/w": ("float32", (6, 2)), "model/b": ("bfloat16", (3,))}
    assert got.shapes == {"model/w": (6, 2), "model/b": (3,)}
    assert (got.step, got.attempt, got.generation, got.world_size) == (
        whole.step, whole.attempt, whole.generation, 1)
    assert got.nbytes == whole.nbytes == 6 * 2 * 4 + 3 * 2
    assert got.training == {"lr": 0.1}
    first = lead(raw[:PREFIX_BYTES], "m")
    assert first is not None
    assert (first.step, first.attempt, first.generation) == (4, whole.attempt, 1)


def test_the_catalog_reads_only_the_lead_of_each_committed_manifest(tmp_path):
    root = str(tmp_path / "r")
    for s in (1, 2, 3):
        _save(root, s)
    storage = _Reads(root)
    found = catalog.committed(storage)
    assert [(c.step, c.generation) for c in found] == [(1, 1), (2, 1), (3, 1)]
    assert storage.reads == [(L.manifest_path(s), [(0, PREFIX_BYTES)]) for s in (1, 2, 3)]
    assert all(c.attempt == decode(_raw(root, c.step), "m").attempt for c in found)


def test_a_format_3_manifest_written_before_the_lead_is_read_to_its_head(tmp_path):
    root = str(tmp_path / "r")
    # the writer before the lead; patched in this process, so the save runs in it
    with mock.patch.object(encode, "_lead_first", dict):
        _save(root, 5, agent=False)
    raw = _raw(root, 5)
    assert b'"lead"' not in raw
    first = lead(raw[:PREFIX_BYTES], "m")
    assert first is not None and first.generation is None and first.step == 5
    storage = _Reads(root)
    assert [(c.step, c.generation) for c in catalog.committed(storage)] == [(5, 1)]
    assert storage.reads == [(L.manifest_path(5), [(0, PREFIX_BYTES)]),
                             (L.manifest_path(5), None)]


def test_every_bit_flip_in_the_lead_is_refused(tmp_path):
    """A flip inside the lead breaks its seal, or its form (then the head is read, and the
    file's digest refuses it). Flips in the file's own digest leave the lead as written: it is
    believed, and the file is refused by whatever reads past the lead."""
    raw = _raw(_save(str(tmp_path / "r")), 4)
    first = lead(raw[:PREFIX_BYTES], "m")
    end = raw.index(b',"head_digest"')  # the lead ends before it
    assert first is not None and end < PREFIX_BYTES
    digest = range(len(b'{"digest":"xxh3_64:'), len(b'{"digest":"xxh3_64:') + 16)
    silent = []
    for i in range(end * 8):
        flipped = bytearray(raw)
        flipped[i // 8] ^= 1 << (i % 8)
        try:
            got = lead(bytes(flipped[:PREFIX_BYTES]), "m")
        except CorruptCheckpoint as e:
            assert str(e) == "m: the manifest's lead does not match its seal (damaged or edited)"
            continue
        if got is None or got.generation is None:
            with pytest.raises(CorruptCheckpoint):
                head(bytes(flipped), "m")
        elif i // 8 in digest:
            assert got == first
            with pytest.raises(CorruptCheckpoint, match="digest does not match"):
                head(bytes(flipped), "m")
        else:
            silent.append(i)
    assert silent == []


def test_a_damaged_lead_is_refused_by_the_catalog_naming_the_manifest(tmp_path):
    root = _save(str(tmp_path / "r"))
    raw = _raw(root, 4)
    _write(root, 4, raw.replace(b'"generation":1,', b'"generation":7,'))
    where = f"{root}/{L.manifest_path(4)}"
    with pytest.raises(CorruptCheckpoint, match=f"^{where}: the manifest's lead does not match"):
        catalog.committed(LocalStorage(root))
    with pytest.raises(CorruptCheckpoint, match=f"^{where}: the manifest's lead"):
        with ckptd.Checkpointer(root, read_only=True) as c:
            c.latest_step()


def test_a_manifest_damaged_past_its_lead_is_listed_and_refused_when_read(tmp_path, capsys):
    root = _save(str(tmp_path / "r"))
    raw = _raw(root, 4)
    _write(root, 4, raw.replace(b'"lr":0.1', b'"lr":0.7'))  # in the head, after the lead
    where = f"{root}/{L.manifest_path(4)}"
    assert [c.step for c in catalog.committed(LocalStorage(root))] == [4]
    with pytest.raises(CorruptCheckpoint, match=f"^{where}: the manifest's digest does not"):
        catalog.read_head(LocalStorage(root), 4)
    # a load reads the head and the entries it needs: the head's own digest refuses it
    with pytest.raises(CorruptCheckpoint, match=f"^{where}: the manifest's head does not"):
        with ckptd.Checkpointer(root, read_only=True) as c:
            c.load({"model": {"w": torch.zeros(6, 2),
                              "b": torch.zeros(3, dtype=torch.bfloat16)}})
    assert cli_main(["ls", root]) == 0
    assert capsys.readouterr().err.startswith(f"damaged: {where}: the manifest's digest")


@pytest.mark.parametrize("fixture, step", [("format1", 3), ("format2", 7)])
def test_a_damaged_head_of_format_1_or_2_is_refused_naming_the_manifest(tmp_path, fixture,
                                                                         step):
    root = str(tmp_path / fixture)
    shutil.copytree(os.path.join(FIXTURES, fixture), root)
    raw = _raw(root, step)
    _write(root, step, raw.replace(b'"world_size":', b'"world_size":-', 1))
    where = f"{root}/{L.manifest_path(step)}"
    reason = "digest does not match" if fixture == "format2" else "-1 is outside"
    with pytest.raises(CorruptCheckpoint, match=f"^{where}: .*{reason}"):
        catalog.read_head(LocalStorage(root), step)
    with pytest.raises(CorruptCheckpoint, match=f"^{where}: "):
        catalog.committed(LocalStorage(root))


def test_a_lead_of_a_newer_version_is_refused_naming_both(tmp_path):
    raw = _raw(_save(str(tmp_path / "r")), 4)
    doc = encode_doc({**decode(raw, "m").to_json(), "version": 99})
    with pytest.raises(CorruptCheckpoint, match=rf"^m: format version 99 is newer .*\({VERSION}\)"):
        lead(doc[:PREFIX_BYTES], "m")


def test_an_attempt_id_too_long_for_the_prefix_leaves_the_lead_to_the_head(tmp_path):
    """The lead is read from the first PREFIX_BYTES: an attempt id that pushes it past them
    (a run id of hundreds of characters, on an object store) is read from the head instead."""
    root = _save(str(tmp_path / "r"))
    long = f"{'r' * 400}-000001"
    manifest = decode(_raw(root, 4), "m")
    raw = encode_doc({**manifest.to_json(), "attempt": long})
    _write(root, 4, raw)
    assert b'"lead"' in raw and lead(raw[:PREFIX_BYTES], "m") is None
    storage = _Reads(root)
    assert catalog.committed(storage) == [catalog.Committed(4, 1, long)]
    assert storage.reads[-1] == (L.manifest_path(4), None)
