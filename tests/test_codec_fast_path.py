"""The manifest codec's fast path (``ckptd.manifest.rows.quick_tensors`` and ``_quick``) decodes
well-formed rows and partials with few Python operations and hands anything off to the full
checks: it must accept nothing that they refuse, and make exactly what they make. Each test
decodes hundreds of mutated partials and manifests twice — as the reader does, and with the
fast path switched off — and compares the outcomes: the same record, or the same error message.
Encoding what was decoded gives back the file's bytes."""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ckptd
from ckptd import config
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import layout as L
from ckptd.manifest import rows
from ckptd.manifest.encode import encode_doc
from ckptd.manifest.envelope import MAX_INT
from ckptd.manifest.parse import decode, whole_doc
from ckptd.manifest.rows import AT


def _state(rank: int) -> dict[str, object]:
    """Rank ``rank`` of two: ``w`` sharded in two rows of chunks, ``v`` with the same shape (the
    boxes it shares with ``w``), ``b`` written by one of its two copies, a 0-d ``step``, values
    of every kind a manifest records."""
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    return {
        "w": ckptd.Shard(w[32 * rank : 32 * rank + 32].clone(), (64, 32), (32 * rank, 0)),
        "v": ckptd.Shard(-w[32 * rank : 32 * rank + 32].clone(), (64, 32), (32 * rank, 0)),
        "b": ckptd.Shard(torch.full((1024,), 0.5, dtype=torch.bfloat16), (1024,), (0,),
                         replica=rank, replicas=2),
        "step": torch.tensor(7, dtype=torch.int64),
        "opt": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adamw"},
        "data": ckptd.Local({"position": 100 + rank, "blob": bytes([0, rank, 255])}),
    }


def _save(root: str, compression: str | None = None) -> tuple[str, list[str]]:
    """Step 1 on two simulated ranks (frames of 1 KiB: several per chunk): the committed
    manifest's path and the partials' paths (kept)."""
    with config.override(frame_bytes=1024, min_frame_bytes=1024):
        cs = [ckptd.Checkpointer(root, rank=r, world_size=2, run_id="codec", agent=False,
                                 compression=compression, keep_last=0) for r in (0, 1)]
        for h in [c.save_async(_state(r), step=1) for r, c in enumerate(cs)]:
            h.result()
    for c in cs:
        c.close()
    [attempt] = os.listdir(os.path.join(root, L.step_dir(1), "ranks"))
    d = os.path.join(root, L.partials_dir(1, attempt))
    return (os.path.join(root, L.manifest_path(1)),
            sorted(os.path.join(d, n) for n in os.listdir(d) if L.is_partial(n)))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[bytes]]:
    manifest, partials = _save(str(tmp_path_factory.mktemp("codec")))
    return _read(manifest), [_read(p) for p in partials]


# ----------------------------------------------------------------------------- bytes back
def test_what_is_decoded_encodes_back_to_the_same_bytes(tmp_path):
    """A partial and a committed manifest, raw and compressed: ``decode(raw).encode() == raw``
    (a coordinator re-encodes nothing it read, but a tool that edits one field must change
    only that field; and both sides of the codec are tested against each other)."""
    for compression in (None, "zstd"):
        manifest, partials = _save(str(tmp_path / str(compression)), compression)
        assert len(partials) == 2
        for path in (manifest, *partials):
            raw = _read(path)
            for eager in (False, True):
                assert decode(raw, path, eager=eager).encode() == raw
            assert encode_doc(whole_doc(raw, path)) == raw
        doc = json.loads(_read(partials[1]))
        assert doc["partial"] == 3 and set(doc["tensors"]) >= {"w", "v"}
        assert doc["locals"] and doc["types"] and doc["replicated"]


# ----------------------------------------------------------------------------- fast == full
def _outcome(raw: bytes, where: str, **kw: Any) -> tuple[Any, ...]:
    """What decoding ``raw`` gives, comparable: the record with every chunk's frame-table
    slice (which ``Chunk.__eq__`` leaves out) and the types of its numbers, or the error."""
    try:
        m = decode(raw, where, **kw)
        tensors = {n: (e.dtype_name, e.shape, [(c, c.ref, [type(x) for x in (
            *c.box.offsets, *c.box.sizes, c.offset, c.length, c.frame_bytes, c.rank)])
                                               for c in e.chunks])
                   for n, e in m.tensors.items()}
        return "ok", m, tensors
    except CorruptCheckpoint as e:
        return "error", str(e)


def _full_checks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "quick_tensors", lambda body, lists: None)
    monkeypatch.setattr(rows, "_quick", lambda *a: None)


HOSTILE_INTS: list[Any] = [-1, 1, 3, 4, 1024, MAX_INT, MAX_INT + 1, 1 << 64, True, False, 1.0,
                           0.0, "0", None, [], [0], {}]
HOSTILE_LISTS: list[Any] = [[], [0], [0, 0, 0], [True, 0], [0, False], [1.0, 0], [0, 0.0],
                            [-1, 0], [0, -1], [1, 0], [0, 1], [64, 0], [0, 32], [MAX_INT, 0],
                            [1 << 64, 0], ["0", 0], [None, 0], [[0], 0], "00", None, 0, {}]
HOSTILE_DIGESTS: list[Any] = ["", "0" * 15, "0" * 17, "A" * 16, "g" * 16, "0" * 15 + "\n",
                              "０" * 16, 5, None, ["0" * 16], True]


def _row_mutations(doc: dict[str, Any], tensors: dict[str, Any],
                   rows_of: Callable[[Any], list[Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every field of every row of ``w``, ``v`` (whose boxes the cache shares) and ``b`` set to
    hostile values, each row's arity and kind broken, one at a time."""
    for name in [n for n in ("w", "v", "b", "step") if n in tensors]:
        for i in range(len(rows_of(tensors[name]))):
            for field, values in [("offsets", HOSTILE_LISTS), ("sizes", HOSTILE_LISTS),
                                  ("digest", HOSTILE_DIGESTS),
                                  *((f, HOSTILE_INTS) for f in (
                                      "file", "offset", "codec", "frame_bytes", "table",
                                      "first"))]:
                for value in values:
                    out = copy.deepcopy(doc)
                    rows_of(_tensors(out)[name])[i][AT[field]] = value
                    yield f"{name}[{i}].{field}={value!r}", out
            for broken in ([], [0], None, "row", {"box": 0}, "ROW8", "ROW10"):
                out = copy.deepcopy(doc)
                r = rows_of(_tensors(out)[name])
                r[i] = (r[i][:8] if broken == "ROW8" else r[i] + [0] if broken == "ROW10"
                        else broken)
                yield f"{name}[{i}]={broken!r}", out


def _tensors(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tensors"]  # type: ignore[no-any-return]


def _list_mutations(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The head's lists that rows index: a path that escapes, an unknown codec, a bad pair."""
    for key, value in [("files", [["/etc/passwd", 0]]), ("files", [["data/../../x", 0]]),
                       ("files", [["", 0]]), ("files", [["data/x\n", 0]]),
                       ("files", [["data/x.bin", True]]), ("files", [["data/x.bin"]]),
                       ("codecs", ["lz4"]), ("codecs", ["zstd"]), ("codecs", [3]),
                       ("tables", ["data/x.bin"]), ("tables", [])]:
        for i in range(len(doc[key]) + 1):
            out = copy.deepcopy(doc)
            out[key] = out[key][:i] + value + out[key][i + 1:]
            yield f"{key}[{i}]={value!r}", out


def _entry_mutations(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A partial's tensors: ``[dtype, shape, rows]`` broken, its dtype and shape hostile (also
    where the cache of declared shapes has seen a look-alike: ``[True, 32]`` after ``[1,
    32]``), names that are no names."""
    for value in ["float33", "bool", "int8", "float64", 4, None, ["float32"]]:
        for name in ("w", "v"):
            out = copy.deepcopy(doc)
            out["tensors"][name]["dtype"] = value
            yield f"{name}.dtype={value!r}", out
    for value in [[], [64], [64, 32, 1], [True, 32], [64.0, 32], [64, 31], [65, 32], [-64, 32],
                  [1 << 62, 1 << 62], [MAX_INT, 1], "64x32", None, [[64], 32]]:
        for name in ("w", "v"):
            out = copy.deepcopy(doc)
            out["tensors"][name]["shape"] = value
            yield f"{name}.shape={value!r}", out
    for huge in (MAX_INT + 1, 1 << 64):  # no elements, so no bytes: the dimension still counts
        out = copy.deepcopy(doc)
        out["tensors"]["v"]["shape"] = [0, huge]
        out["tensors"]["v"]["chunks"] = [[[0, 0], [0, 32], *r[2:]] for r in
                                         out["tensors"]["v"]["chunks"][:1]]
        yield f"v.shape=[0, {huge}]", out
    out = copy.deepcopy(doc)  # two tensors whose shapes differ in type only
    out["tensors"]["v"]["shape"] = [True, 32]
    out["tensors"]["v"]["chunks"] = [[[0, 0], [1, 32], *r[2:]] for r in
                                     out["tensors"]["v"]["chunks"][:1]]
    out["tensors"]["w"]["shape"] = [1, 32]
    out["tensors"]["w"]["chunks"] = [[[0, 0], [1, 32], *r[2:]] for r in
                                     out["tensors"]["w"]["chunks"][:1]]
    yield "look-alike shapes", out
    for name in ("", "a\0b"):
        out = copy.deepcopy(doc)
        out["tensors"] = {name: out["tensors"].pop("w"), **out["tensors"]}
        yield f"name {name!r}", out


def _box_cache_mutations(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A box the cache has seen, then its look-alike (True for 1, 1.0 for 1) in a later row of
    a tensor of the same shape."""
    for fake in (True, 1.0):
        out = copy.deepcopy(doc)
        w, v = out["tensors"]["w"]["chunks"][0], out["tensors"]["v"]["chunks"][0]
        w[AT["offsets"]], w[AT["sizes"]] = [1, 0], [1, 32]
        v[AT["offsets"]], v[AT["sizes"]] = [fake, 0], [1, 32]
        yield f"box look-alike {fake!r}", out


def _partial_doc(raw: bytes) -> dict[str, Any]:
    doc = whole_doc(raw, "p")
    assert doc["partial"] == 3
    return doc


def _compare(monkeypatch: pytest.MonkeyPatch, cases: list[tuple[str, bytes]], **kw: Any,
             ) -> list[tuple[Any, ...]]:
    fast = [_outcome(raw, "m", **kw) for _, raw in cases]
    with monkeypatch.context() as m:
        _full_checks_only(m)
        full = [_outcome(raw, "m", **kw) for _, raw in cases]
    differ = [(label, f, g) for (label, _), f, g in zip(cases, fast, full, strict=True)
              if f != g]
    assert differ == []
    return fast


def test_the_fast_path_decodes_every_mutated_partial_as_the_full_checks_do(saved, monkeypatch):
    _, partials = saved
    [doc] = [d for d in map(_partial_doc, partials) if "b" in d["tensors"]]  # b: one copy
    assert {"w", "v", "b"} <= set(doc["tensors"]), doc["tensors"].keys()
    cases = [(label, encode_doc(d)) for label, d in (
        ("as written", doc),
        *_row_mutations(doc, doc["tensors"], lambda t: t["chunks"]),
        *_list_mutations(doc), *_entry_mutations(doc), *_box_cache_mutations(doc))]
    outcomes = _compare(monkeypatch, cases, eager=True)
    assert outcomes[0][0] == "ok"
    refused = sum(o[0] == "error" for o in outcomes)
    assert len(cases) > 500 and refused > 0.8 * len(cases), (len(cases), refused)


def test_the_fast_path_decodes_every_mutated_manifest_as_the_full_checks_do(saved, monkeypatch):
    """A committed manifest's entries, decoded at once (eager) and each when first used."""
    manifest, _ = saved
    doc = whole_doc(manifest, "m")
    cases = [(label, encode_doc(d)) for label, d in (
        ("as written", doc),
        *_row_mutations(doc, doc["tensors"], lambda t: t["chunks"]),
        *_list_mutations(doc), *_box_cache_mutations(doc))]
    for eager in (True, False):
        outcomes = _compare(monkeypatch, cases, eager=eager)
        assert outcomes[0][0] == "ok"
        assert sum(o[0] == "error" for o in outcomes) > 0.8 * len(cases)


def test_a_chunk_made_by_the_fast_path_is_a_chunk(saved):
    """What the fast path makes of a row is what the dataclasses' constructors make: the same
    fields, equal and hashing alike, and as small (a ``__dict__`` sharing its keys)."""
    import dataclasses

    from ckptd.manifest.frames import FrameRef
    from ckptd.manifest.schema import Chunk

    _, partials = saved
    for e in decode(partials[0], "p", eager=True).tensors.values():
        for c in e.chunks:
            assert c.ref is not None
            ref = FrameRef(c.ref.table, c.ref.first, c.ref.count, c.ref.digest)
            assert vars(c.ref) == vars(ref) and c.ref == ref and hash(c.ref) == hash(ref)
            made = Chunk(c.box, c.file, c.offset, c.length, c.codec, c.frame_bytes, None,
                         c.rank, ref)
            assert vars(c) == vars(made) and c == made and hash(c) == hash(made)
            # and as small: a chunk's __dict__ shares its keys with every other chunk's (a
            # dict assigned whole does not: twice the memory, +9 MiB in a 1024-rank coordinator)
            assert sys.getsizeof(vars(c)) == sys.getsizeof(vars(made))
            assert sys.getsizeof(vars(c.ref)) == sys.getsizeof(vars(ref))
            assert [f.name for f in dataclasses.fields(Chunk)] == list(vars(c))
            with pytest.raises(dataclasses.FrozenInstanceError):
                c.offset = 1  # type: ignore[misc]
