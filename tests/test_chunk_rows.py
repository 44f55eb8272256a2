"""Chunk rows (manifest version 5, partial version 3; docs/format.md, *Chunk rows*): what they
hold, that a coordinator merges them beside partials of earlier versions, and that a row built
to hurt is a one-line CorruptCheckpoint naming the file and the tensor, from a load (which
leaves its destination untouched), `ckptd verify` and the coordinator alike."""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from manifest_doc import row, set_file

import ckptd
from ckptd import catalog, config
from ckptd.cli import main as cli_main
from ckptd.errors import CkptdError, CorruptCheckpoint
from ckptd.loader.verify import verify
from ckptd.manifest import layout as L
from ckptd.manifest.encode import encode_doc
from ckptd.manifest.parse import decode, whole_doc
from ckptd.manifest.rows import AT, FIELDS
from ckptd.storage.local import LocalStorage
from ckptd.writer import commit

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
N = 4096


def _state(rank: int) -> dict[str, object]:
    """Rank ``rank`` of two: half of ``w`` each, ``b`` written by one of its two copies."""
    w = torch.arange(float(2 * N)).reshape(64, -1)
    return {"w": ckptd.Shard(w[32 * rank : 32 * rank + 32].clone(), (64, 128), (32 * rank, 0)),
            "b": ckptd.Shard(torch.full((N,), 0.5), (N,), (0,), replica=rank, replicas=2),
            "lr": 0.1}


def _dest() -> dict[str, object]:
    return {"w": torch.full((64, 128), -1.0), "b": torch.full((N,), -1.0), "lr": -1.0}


def _untouched(dst) -> bool:  # type: ignore[no-untyped-def]
    return (torch.equal(dst["w"], torch.full((64, 128), -1.0))
            and torch.equal(dst["b"], torch.full((N,), -1.0)) and dst["lr"] == -1.0)


def _save(root: str, *, commit_it: bool = True) -> list[ckptd.Checkpointer]:
    """Step 1 on two simulated ranks (frames of 4 KiB: several per chunk); uncommitted (its
    manifest removed) unless ``commit_it``."""
    with config.override(frame_bytes=4096, min_frame_bytes=4096):
        cs = [ckptd.Checkpointer(root, rank=r, world_size=2, run_id="rows", agent=False)
              for r in (0, 1)]
        for h in [c.save_async(_state(r), step=1) for r, c in enumerate(cs)]:
            h.result()
    for c in cs:
        c.close()
    if not commit_it:
        os.unlink(os.path.join(root, L.manifest_path(1)))
    return cs


def _attempt_dir(root: str) -> str:
    [attempt] = os.listdir(os.path.join(root, L.step_dir(1), "ranks"))
    return os.path.join(root, L.partials_dir(1, attempt))


# ----------------------------------------------------------------------------- the rows
def test_a_manifest_holds_each_chunk_as_a_row_of_at_most_70_bytes(tmp_path):
    root = str(tmp_path / "r")
    _save(root)
    with open(os.path.join(root, L.manifest_path(1)), "rb") as f:
        raw = f.read()
    doc = json.loads(raw)
    assert doc["version"] == 5
    assert [p for p, _ in doc["files"]] == sorted(p for p, _ in doc["files"])
    assert {r for _, r in doc["files"]} == {0, 1} and doc["codecs"] == ["raw"]
    rows = [r for t in doc["tensors"].values() for r in t["chunks"]]
    assert len(rows) == 3 and all(len(r) == len(FIELDS) for r in rows)
    longest = max(len(json.dumps(r, separators=(",", ":"))) for r in rows)
    assert longest <= 70, longest
    tail = raw[raw.index(b',"tensors":'):]
    for key in (b'"box"', b'"file"', b'"offset"', b'"length"', b'"frame_bytes"', b'"rank"'):
        assert key not in tail
    # what a reader derives: the length from the box, the frame count from frame_bytes
    m = decode(raw, "m")
    w = sorted(m.tensors["w"].chunks, key=lambda c: c.box.offsets)
    assert [(c.box.offsets, c.box.sizes, c.length, c.rank, c.codec) for c in w] == [
        ((0, 0), (32, 128), 32 * 128 * 4, 0, "raw"), ((32, 0), (32, 128), 32 * 128 * 4, 1, "raw")]
    assert [c.ref.count for c in w if c.ref] == [4, 4]
    assert all(c.file == doc["files"][r[AT["file"]]][0] for c, r in
               zip(w, doc["tensors"]["w"]["chunks"], strict=True))


def test_a_partial_of_version_3_has_no_index_and_no_key_per_chunk(tmp_path):
    root = str(tmp_path / "r")
    _save(root)
    for name in sorted(os.listdir(_attempt_dir(root))):
        with open(os.path.join(_attempt_dir(root), name), "rb") as f:
            raw = f.read()
        doc = json.loads(raw)
        assert (doc["partial"], doc["version"]) == (3, 5)
        assert "index" not in doc and "nbytes" not in doc
        for entry in doc["tensors"].values():  # [dtype, shape, rows]
            assert [type(x) for x in entry] == [str, list, list]
        tail = raw[raw.index(b',"tensors":'):]
        assert b'"chunks"' not in tail and b'"box"' not in tail and b'"dtype"' not in tail
        assert set(decode(raw, name).tensors) == set(doc["tensors"])


def test_the_whole_document_encodes_back_to_the_same_bytes(tmp_path):
    """One encoder: what `whole_doc` reads, `encode_doc` writes byte for byte — a manifest
    and a partial (tools that edit a manifest change only what they edit)."""
    root = str(tmp_path / "r")
    _save(root)
    partial = os.path.join(_attempt_dir(root), "00001.json")
    for path in (os.path.join(root, L.manifest_path(1)), partial):
        with open(path, "rb") as f:
            raw = f.read()
        assert encode_doc(whole_doc(raw, path)) == raw
        assert decode(raw, path).to_json() == whole_doc(raw, path)


def test_inspect_shows_the_rows_and_their_files(tmp_path, capsys):
    root = str(tmp_path / "r")
    _save(root)
    assert cli_main(["inspect", "--json", root]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 5 and len(doc["files"]) == 2
    [b] = doc["tensors"]["b"]["chunks"]
    assert (b[AT["offsets"]], b[AT["sizes"]]) == ([0], [N])
    assert cli_main(["inspect", root]) == 0
    assert re.search(r"\bw\s+float32\s+64x128\s+2\b", capsys.readouterr().out)
    assert cli_main(["verify", root]) == 0


# ----------------------------------------------------------------------------- merging
def _format4_uncommitted(tmp_path) -> tuple[LocalStorage, str]:
    """tests/fixtures/format4 (manifest version 4, partials of version 2) copied, its step
    uncommitted: the partials of an attempt that a crash left behind before an upgrade."""
    root = str(tmp_path / "format4")
    shutil.copytree(os.path.join(FIXTURES, "format4"), root)
    os.unlink(os.path.join(root, L.manifest_path(5)))
    return LocalStorage(root), L.partials_dir(5, "format4-000001")


def _check_format4_step(storage: LocalStorage) -> None:
    m = catalog.read_manifest(storage, 5)
    assert json.loads(storage.read_bytes(L.manifest_path(5)))["version"] == 5
    dst = {"model": {"w": torch.zeros(6, 8), "b": torch.zeros(4),
                     "e": torch.zeros(6, dtype=torch.bfloat16)}, "step": -1}
    with ckptd.Checkpointer(storage.url, read_only=True) as c:
        assert c.load(dst, strict=False).step == 5
    assert torch.equal(dst["model"]["w"], torch.arange(48.0).reshape(6, 8))
    assert torch.equal(dst["model"]["b"], torch.full((4,), 0.5))
    assert torch.equal(dst["model"]["e"], torch.arange(6, dtype=torch.bfloat16))
    assert m.locals == {"0": {"data": {"position": 100, "blob": b"\x00\x01\x00"}},
                        "1": {"data": {"position": 101, "blob": b"\x00\x01\x01"}}}
    assert cli_main(["verify", storage.url]) == 0


def test_partials_of_version_2_written_before_the_upgrade_are_committed_as_version_5(
        tmp_path):
    storage, _ = _format4_uncommitted(tmp_path)
    m = commit.finalize(storage, 5)
    assert m is not None and len(m.tensors) == 5
    _check_format4_step(storage)


def test_partials_of_versions_1_2_and_3_of_one_attempt_merge(tmp_path):
    """A root written across an upgrade: rank 0's partial rewritten by today's writer
    (version 3, rows), rank 1's of version 2 as the fixture has it — and then as version 1
    (what it holds by name)."""
    storage, d = _format4_uncommitted(tmp_path)
    p0, p1 = f"{d}/00000.json", f"{d}/00001.json"
    old0 = storage.read_bytes(p0)
    storage.put_atomic(p0, decode(old0, p0).encode())
    assert json.loads(storage.read_bytes(p0))["partial"] == 3
    assert json.loads(storage.read_bytes(p1))["partial"] == 2
    m = commit.finalize(storage, 5)
    assert m is not None
    _check_format4_step(storage)

    storage, d = _format4_uncommitted(tmp_path / "again")
    storage.put_atomic(p0, decode(old0, p0).encode())
    doc = whole_doc(storage.read_bytes(p1), p1)
    [(_, count, _, wrote)] = doc.pop("replicated")
    del doc["partial"]
    doc["holds"] = ["model/b"]
    assert (count, wrote, doc["version"]) == (2, ["model/e"], 4)
    storage.put_atomic(p1, encode_doc(doc))
    assert decode(storage.read_bytes(p1), p1).partial == 1
    assert commit.finalize(storage, 5) is not None
    _check_format4_step(storage)


# ----------------------------------------------------------------------------- hostile rows
def _tamper(path: str, fn) -> None:  # type: ignore[no-untyped-def]
    with open(path, "rb") as f:
        doc = whole_doc(f.read(), path)
    fn(doc)
    with open(path, "wb") as f:
        f.write(encode_doc(doc))


def _set(field: str, value: object):  # type: ignore[no-untyped-def]
    def edit(doc) -> None:  # type: ignore[no-untyped-def]
        row(doc, "b")[AT[field]] = value
    return edit


def _arity(n: int):  # type: ignore[no-untyped-def]
    def edit(doc) -> None:  # type: ignore[no-untyped-def]
        r = row(doc, "b")
        del r[n:]
        r.extend([0] * (n - len(r)))
    return edit


def _path(evil: str):  # type: ignore[no-untyped-def]
    return lambda doc: set_file(doc, row(doc, "b"), evil)


HOSTILE = [
    ("eight fields", _arity(8), r"a chunk is \[offsets, sizes, file, offset, codec, frame_bytes, "
                                r"table, first, digest\], got \["),
    ("ten fields", _arity(10), r"a chunk is \[offsets, .*, got \["),
    ("not a list", lambda d: d["tensors"]["b"]["chunks"].__setitem__(0, {"box": [[0], [N]]}),
     r"a chunk is \[offsets"),
    ("offset as text", _set("offset", "0"), r"expected an integer, got '0'"),
    ("first as text", _set("first", "x"), r"expected an integer, got 'x'"),
    ("frame_bytes true", _set("frame_bytes", True), r"expected an integer, got True"),
    ("sizes as text", _set("sizes", "4096"), r"expected a list of integers, got '4096'"),
    ("file out of range", _set("file", 7), r"file 7 is not in the manifest's \d files"),
    ("codec out of range", _set("codec", 1), r"codec 1 is not in the manifest's 1 codecs"),
    ("table out of range", _set("table", 99), r"frame table 99 is not in the manifest's \d "),
    ("negative file", _set("file", -1), r"-1 is outside \[0, "),
    ("negative offset", _set("offset", -16), r"-16 is outside \[0, "),
    ("huge first", _set("first", 1 << 63), r"9223372036854775808 is outside \[0, "),
    ("huge size", _set("sizes", [1 << 62]), r"box .* outside shape \[4096\]"),
    ("box past the shape", _set("offsets", [1]), r"box \[\[1\], \[4096\]\] outside shape"),
    ("zero frame_bytes", _set("frame_bytes", 0), r"0 is outside \[1, "),
    ("odd frame_bytes", _set("frame_bytes", 6), r"frame size 6 is not a multiple of the item "),
    ("digest not hex", _set("digest", "z" * 16), r"frames digest 'zzzz.*' is not 16 hex"),
    ("escaping path", _path("data/../../../etc/passwd"), r"escapes the checkpoint directory"),
    ("absolute path", _path("/etc/passwd"), r"escapes the checkpoint directory"),
    ("path outside data", _path("ranks/x/00000.json"), r"escapes the checkpoint directory"),
]


@pytest.mark.parametrize("edit, reason", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_row_is_refused_naming_the_manifest_and_tensor(tmp_path, edit, reason):
    root = str(tmp_path / "r")
    _save(root)
    path = os.path.join(root, L.manifest_path(1))
    _tamper(path, edit)
    dst = _dest()
    with pytest.raises(CorruptCheckpoint) as err:
        with ckptd.Checkpointer(root, read_only=True) as c:
            c.load(dst, step=1)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{root}/{L.manifest_path(1)}: b: ")
    assert re.search(reason, message), message
    assert _untouched(dst)
    storage = LocalStorage(root)
    with ThreadPoolExecutor(2) as pool:
        try:
            problems = verify(storage, L.step_dir(1), catalog.read_manifest(storage, 1),
                              pool).problems
        except CkptdError as e:
            problems = [str(e)]
    assert any(p.startswith(f"{root}/{L.manifest_path(1)}: b: ") and re.search(reason, p)
               for p in problems), problems


@pytest.mark.parametrize("edit, reason", [h[1:] for h in HOSTILE[::3]],
                         ids=[h[0] for h in HOSTILE[::3]])
def test_a_hostile_row_in_a_partial_is_refused_by_the_coordinator(tmp_path, edit, reason):
    root = str(tmp_path / "r")
    _save(root, commit_it=False)
    [name] = [n for n in os.listdir(_attempt_dir(root))  # the rank that wrote b (one copy)
              if "b" in json.loads(open(os.path.join(_attempt_dir(root), n), "rb").read())[
                  "tensors"]]
    _tamper(os.path.join(_attempt_dir(root), name), edit)
    storage = LocalStorage(root)
    with pytest.raises(CorruptCheckpoint) as err:
        commit.finalize(storage, 1)
    message = str(err.value)
    assert "\n" not in message and re.search(reason, message), message
    assert re.search(rf"ranks/rows-\d+/{name}: b: ", message), message
    assert not storage.exists(L.manifest_path(1))


@pytest.mark.parametrize("edit, reason", [
    (lambda d: d.update(files=[["data/x.bin"]]), r"files\[0\] is not \[path, rank\]"),
    (lambda d: d.update(files=[["data/x.bin", -1]]), r"-1 is outside"),
    (lambda d: d.update(files={"data/x.bin": 0}), r"'files' is not a list"),
    (lambda d: d.update(codecs=[3]), r"'codecs' is not a list of names"),
    (lambda d: d.update(codecs=["lz4"]), r"[bw]: malformed chunk 0 .*unknown codec 'lz4'"),
    (lambda d: d.pop("files"), r"KeyError: 'files'"),
], ids=["short pair", "negative rank", "object", "codec number", "unknown codec", "missing"])
def test_a_hostile_list_of_files_or_codecs_is_refused_naming_the_manifest(tmp_path, edit,
                                                                         reason):
    root = str(tmp_path / "r")
    _save(root)
    _tamper(os.path.join(root, L.manifest_path(1)), edit)
    dst = _dest()
    with pytest.raises(CorruptCheckpoint, match=rf"^{root}/{L.manifest_path(1)}: .*{reason}"):
        with ckptd.Checkpointer(root, read_only=True) as c:
            c.load(dst, step=1)
    assert _untouched(dst)


def test_a_tensor_of_a_partial_that_is_no_triple_is_refused_naming_it(tmp_path):
    root = str(tmp_path / "r")
    _save(root, commit_it=False)
    partial = os.path.join(_attempt_dir(root), "00001.json")
    with open(partial, "rb") as f:
        raw = f.read()
    # the tail as the file has it: "w": ["float32", [64, 128], [rows]] -> without its dtype
    bad = raw.replace(b'"w":["float32",', b'"w":[')
    assert bad != raw
    from ckptd.manifest.envelope import seal, tail_field

    cut = bad.index(b',"tensors":')
    head, tail = bad[bad.index(b'"format"') : cut], bad[cut:]
    with open(partial, "wb") as f:
        f.write(seal(tail_field(len(tail)) + head + tail))
    with pytest.raises(CorruptCheckpoint,
                       match=r"00001\.json: w: a tensor is \[dtype, shape, chunks\], got \[\["):
        commit.finalize(LocalStorage(root), 1)
