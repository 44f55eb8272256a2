"""Manifests and roots built to hurt: lying frame tables, absurd sizes, hostile JSON, flipped
bits, links and FIFOs inside the root. Each is refused with a one-line CkptdError naming the file
(and tensor), by `load` and by `ckptd verify` alike, before any destination tensor is touched and
without allocating what the manifest claims."""

from __future__ import annotations

import json
import logging
import os
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from manifest_doc import file_of, frames_of, length_of, row, set_codec, set_file

import ckptd
from ckptd import catalog, config
from ckptd.cli import main as cli_main
from ckptd.errors import CkptdError, CorruptCheckpoint, StorageError
from ckptd.loader.verify import verify
from ckptd.manifest import layout as L
from ckptd.manifest.encode import encode_doc
from ckptd.manifest.envelope import seal
from ckptd.manifest.parse import decode, whole_doc
from ckptd.manifest.rows import AT
from ckptd.storage import posix
from ckptd.storage.local import LocalStorage

N = 4096  # elements of each 1-D tensor


@pytest.fixture
def root(tmp_path):
    """Step 1: two raw float32 tensors of 16 KiB, each one chunk of four 4 KiB frames."""
    r = str(tmp_path / "root")
    with config.override(frame_bytes=4096, min_frame_bytes=4096):
        with ckptd.Checkpointer(r, run_id="writer") as c:
            c.save({"a": torch.arange(float(N)), "b": torch.arange(float(N)) * 2}, step=1)
    return r


def _dest():
    return {"a": torch.full((N,), -1.0), "b": torch.full((N,), -1.0)}


def _untouched(dst) -> bool:
    return all(torch.equal(t, torch.full((N,), -1.0)) for t in dst.values())


def _path(root, step=1):
    return os.path.join(root, L.manifest_path(step))


def _tamper(root, fn, step=1):
    with open(_path(root, step), "rb") as f:
        doc = whole_doc(f.read(), "test")
    fn(doc)
    with open(_path(root, step), "wb") as f:
        f.write(encode_doc(doc))


def _write_raw(root, text: bytes, step=1):
    """Replace the manifest with exactly these bytes, sealed (a hostile but well-signed file)."""
    with open(_path(root, step), "wb") as f:
        f.write(seal(text) if text.startswith(b"{") else text)


def _load_error(root, dst=None, **kw) -> str:
    dst = _dest() if dst is None else dst
    with pytest.raises(CkptdError) as err:
        with ckptd.Checkpointer(root, read_only=True) as c:
            c.load(dst, step=1, **kw)
    assert _untouched(dst)
    message = str(err.value)
    assert "\n" not in message
    return message


def _verify_problems(root) -> list[str]:
    storage = LocalStorage(root)
    with ThreadPoolExecutor(2) as pool:
        try:
            manifest = catalog.read_manifest(storage, 1)
        except CkptdError as e:
            return [str(e)]
        return verify(storage, L.step_dir(1), manifest, pool).problems


def _both_refuse(root, pattern: str) -> None:
    """load and verify agree: each refuses, with the same reason."""
    import re

    message = _load_error(root)
    assert re.search(pattern, message), message
    problems = _verify_problems(root)
    assert problems and any(re.search(pattern, p) for p in problems), problems


# ----------------------------------------------------------------------------- frame tables
def _set_frames(root, doc, chunk, frames) -> None:
    """Point ``chunk`` (a row) at a new, well-signed frame table slice holding ``frames``
    (``[stored, hex checksum]`` pairs): what an adversary who rewrites the table and the
    manifest can do."""
    from ckptd.manifest.frames import FrameTable, table_file

    blob, [(first, _, digest)] = table_file([FrameTable.from_json(frames)])
    name = f"data/{doc['attempt']}/evil{len(doc['tables'])}.frames"
    with open(os.path.join(root, L.step_dir(doc["step"]), name), "wb") as f:
        f.write(blob)
    doc["tables"].append(name)
    chunk[AT["table"]], chunk[AT["first"]], chunk[AT["digest"]] = (
        len(doc["tables"]) - 1, first, digest)


def _frames_of(root, doc, tensor, chunk) -> list[list]:
    """``chunk``'s frames as ``[stored, hex checksum]`` pairs, from its table slice."""
    from ckptd.manifest.frames import FrameRef, parse_slice

    ref = FrameRef(*frames_of(doc, tensor, chunk))
    lo, n = ref.byte_range
    with open(os.path.join(root, L.step_dir(doc["step"]), ref.table), "rb") as f:
        f.seek(lo)
        return parse_slice(f.read(n), ref, "test").to_json()


def test_raw_frames_of_the_wrong_sizes_are_refused_by_load_and_verify(root):
    def uneven(doc):  # [L/4, 3L/4] with frame_bytes L/2; checksums of those very bytes
        chunk = row(doc, "b")
        data = open(os.path.join(root, L.step_dir(1), file_of(doc, chunk)), "rb").read()
        lo, n = chunk[AT["offset"]], length_of(doc, "b", chunk)
        import xxhash

        first, second = data[lo : lo + n // 4], data[lo + n // 4 : lo + n]
        chunk[AT["frame_bytes"]] = n // 2
        _set_frames(root, doc, chunk, [[len(first), xxhash.xxh3_64_hexdigest(first)],
                                       [len(second), xxhash.xxh3_64_hexdigest(second)]])

    _tamper(root, uneven)
    _both_refuse(root, r"evil\d\.frames: b: malformed frame table .*raw frame 0 stores 4096 bytes "
                       r"for 8192")


def test_a_raw_chunk_claiming_one_frame_of_half_its_length_is_refused_before_any_copy(root):
    def half(doc):
        chunk = row(doc, "b")
        checksum = _frames_of(root, doc, "b", chunk)[0][1]
        chunk[AT["frame_bytes"]] = n = length_of(doc, "b", chunk)
        _set_frames(root, doc, chunk, [[n // 2, checksum]])

    _tamper(root, half)
    _both_refuse(root, r"b: malformed frame table .*raw frame 0 stores 8192 bytes for 16384")


def test_a_frame_past_the_end_of_its_file_is_refused_without_allocating_it(root):
    def compressed_and_huge(doc):  # zstd frames may be larger than raw; not past the file
        chunk = row(doc, "a")
        set_codec(doc, chunk, "zstd")
        frames = _frames_of(root, doc, "a", chunk)
        frames[-1][0] = 2 * 4096 + 4096  # the largest stored size allowed
        _set_frames(root, doc, chunk, frames)
        chunk[AT["offset"]] = (1 << 40)  # a terabyte into a 32 KiB file

    _tamper(root, compressed_and_huge)
    tracemalloc.start()
    try:
        message = _load_error(root)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "past the end of the" in message and "a" in message.split(": ")[1]
    assert peak < 16 << 20, peak
    assert any("past the end" in p for p in _verify_problems(root))


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("offset", 1 << 63, r"outside \[0, 4611686018427387904\]"),
        ("offset", -16, r"-16 is outside"),
        # one frame for the whole chunk: the run of the table it names is 1 frame, not 4
        ("frame_bytes", 1 << 62, r"a: .*frame table slice at frame 0 does not match its digest"),
        ("file", "data/x\u0000y.bin", r"escapes the checkpoint directory"),
        ("sizes", [-4], r"-4 is outside"),
    ],
)
def test_absurd_numbers_and_names_are_corrupt_checkpoints(root, field, value, reason):
    def absurd(doc):
        if field == "file":
            set_file(doc, row(doc, "a"), value)
        else:
            row(doc, "a")[AT[field]] = value

    _tamper(root, absurd)
    _both_refuse(root, reason)


def test_absurd_frame_sizes_are_corrupt_checkpoints(root):
    def huge(doc):
        chunk = row(doc, "a")
        set_codec(doc, chunk, "zstd")
        _set_frames(root, doc, chunk, [[1 << 62, "0" * 16]] * 4)

    _tamper(root, huge)
    _both_refuse(root, r"a: malformed frame table .*outside \[1, 12288\]")


@pytest.mark.parametrize(
    "text, reason",
    [
        (b"[" * 100_000 + b"]" * 100_000, r"nested too deeply|not valid JSON"),
        (b'{"format":"ckptd","version":' + b"7" * 5000 + b"}", r"not valid JSON"),
        (b'{"format":"ckptd","format":"ckptd"}', r"duplicate key 'format'"),
    ],
    ids=["deep", "long-int", "duplicate-key"],
)
def test_hostile_json_is_a_corrupt_checkpoint(root, text, reason):
    _write_raw(root, text)
    _both_refuse(root, reason)


def test_a_shape_whose_size_overflows_is_corrupt(root):
    _tamper(root, lambda d: d["tensors"]["a"].update(shape=[1 << 40, 1 << 40]))
    _both_refuse(root, r"a: shape \[1099511627776, 1099511627776\] is impossibly large")


def test_a_manifest_over_the_size_limit_is_refused_before_it_is_parsed(root):
    with config.override(max_manifest_bytes=100):
        _both_refuse(root, r"over the manifest limit of 100 ")


# ----------------------------------------------------------------------------- the digest
def test_every_single_bit_flip_of_a_manifest_is_detected(tmp_path):
    r = str(tmp_path / "small")
    with ckptd.Checkpointer(r, run_id="w") as c:
        c.save({"w": torch.ones(3), "lr": 0.001, "step": 10})
    raw = open(_path(r, 10), "rb").read()
    decode(raw, "ok")  # the original is fine
    silent = []
    for i in range(len(raw) * 8):
        flipped = bytearray(raw)
        flipped[i // 8] ^= 1 << (i % 8)
        try:
            decode(bytes(flipped), "flipped")
        except CorruptCheckpoint:
            continue
        silent.append(i)
    assert silent == [], f"{len(silent)} of {len(raw) * 8} flips went unnoticed"


def test_a_manifest_of_format_1_without_a_digest_still_loads(tmp_path):
    """A checkpoint written by ckptd 0.1.0 (format version 1), kept as a fixture."""
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "format1")
    dst = {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}, "step": -1}
    with ckptd.Checkpointer(fixture, read_only=True) as c:
        result = c.load(dst)
    assert result.step == 3 and dst["step"] == 3
    assert torch.equal(dst["model"]["w"], torch.arange(16.0).reshape(4, 4))
    assert torch.equal(dst["model"]["b"], torch.full((4,), 0.5))


def test_a_checkpoint_of_format_2_with_frames_inline_still_loads(tmp_path):
    """Written by ckptd before the binary frame tables (format version 2: frames inline in the
    JSON), two ranks, zstd-planes, kept as a fixture; it loads into one rank and verifies."""
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "format2")
    dst = {"model": {"w": torch.zeros(8, 8), "b": torch.zeros(4)}, "step": -1}
    with ckptd.Checkpointer(fixture, read_only=True) as c:
        result = c.load(dst)
    assert result.step == 7 and dst["step"] == 7
    assert torch.equal(dst["model"]["w"], torch.arange(64.0).reshape(8, 8))
    assert torch.equal(dst["model"]["b"], torch.full((4,), 0.5))
    assert cli_main(["verify", fixture]) == 0


# ----------------------------------------------------------------------------- links, FIFOs
def test_a_symlinked_metrics_file_is_never_written_through(tmp_path, caplog):
    r = tmp_path / "root"
    r.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, r / L.METRICS)
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        with ckptd.Checkpointer(str(r), run_id="w") as c:
            c.save({"w": torch.ones(2)}, step=1)
    assert victim.read_text() == "precious\n"
    assert "symbolic link inside the checkpoint root" in caplog.text


def test_a_planted_step_link_receives_nothing(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, r / L.step_dir(5))
    with ckptd.Checkpointer(str(r), run_id="w") as c:
        with pytest.raises(StorageError, match=rf"{L.step_dir(5)}: a symbolic link inside the "
                                                r"checkpoint root"):
            c.save({"w": torch.ones(2)}, step=5)
    assert os.listdir(elsewhere) == []


def test_retention_never_deletes_through_a_symlinked_step(tmp_path):
    r = tmp_path / "root"
    with ckptd.Checkpointer(str(r), run_id="w", keep_last=0) as c:
        c.save({"w": torch.ones(2)}, step=1)
    outside = tmp_path / "outside"
    os.rename(r / L.step_dir(1), outside)  # a step that lives elsewhere, linked back in
    os.symlink(outside, r / L.step_dir(1))
    with ckptd.Checkpointer(str(r), run_id="w2", keep_last=1) as c:
        c.save({"w": torch.ones(2)}, step=2)  # retention then looks at step 1
        c.save({"w": torch.ones(2)}, step=3)
    assert os.path.exists(outside / L.MANIFEST)  # nothing deleted through the link


def test_a_directory_replaced_by_a_link_between_two_writes_receives_nothing(tmp_path):
    """Each write resolves its directories again, without following a link: a data directory
    swapped for a link to elsewhere after the first file is refused at the second."""
    s = LocalStorage(str(tmp_path / "root"))
    s.write_file("step-000000001/data/a/r0-0.bin", [b"first"])
    elsewhere = tmp_path / "elsewhere"
    os.rename(tmp_path / "root" / "step-000000001" / "data", elsewhere)
    os.symlink(elsewhere, tmp_path / "root" / "step-000000001" / "data")
    with pytest.raises(StorageError, match=r"step-000000001/data: a symbolic link inside the "
                                           r"checkpoint root"):
        s.write_file("step-000000001/data/a/r0-1.bin", [b"second"])
    with pytest.raises(StorageError, match="a symbolic link inside the checkpoint root"):
        s.put_atomic("step-000000001/data/a/partial.json", b"{}")
    assert sorted(os.listdir(elsewhere / "a")) == ["r0-0.bin"]


@pytest.mark.skipif(not posix._openat2_ok, reason="no openat2(2) on this system")
def test_a_write_below_existing_directories_opens_them_in_one_call(tmp_path, monkeypatch):
    """With openat2(2): the root, then the directories below it in one call that follows no
    link (not one open per component: on a shared filesystem each is a metadata operation)."""
    import ckptd.storage.local as local
    import ckptd.storage.local_dirs as local_dirs

    s = LocalStorage(str(tmp_path / "root"))
    s.write_file("step-000000001/data/a/r0-0.bin", [b"first"])  # makes the directories
    walked: list[str] = []

    def counted(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        walked.append(name)
        return posix.open_at(name, *args, **kwargs)

    beneath: list[str] = []

    def counted_beneath(dir_fd, path, *args):  # type: ignore[no-untyped-def]
        beneath.append(path)
        return posix.open_beneath(dir_fd, path, *args)

    monkeypatch.setattr(local, "open_at", counted)  # the file
    monkeypatch.setattr(local_dirs, "open_at", counted)  # the walk
    monkeypatch.setattr(local_dirs, "open_beneath", counted_beneath)
    s.write_file("step-000000001/data/a/r0-1.bin", [b"second"])
    assert walked == ["r0-1.bin"] and beneath == ["step-000000001/data/a"], (walked, beneath)
    with open(tmp_path / "root" / "step-000000001" / "data" / "a" / "r0-1.bin", "rb") as f:
        assert f.read() == b"second"


def test_a_data_file_linking_outside_the_root_is_refused(root, tmp_path):
    doc = json.loads(open(_path(root), "rb").read())
    chunk_file = file_of(doc, row(doc, "a"))
    inside = os.path.join(root, L.step_dir(1), chunk_file)
    copy = tmp_path / "copy.bin"
    copy.write_bytes(open(inside, "rb").read())  # identical bytes: checksums would pass
    os.unlink(inside)
    os.symlink(copy, inside)
    _both_refuse(root, r"a symbolic link inside the checkpoint root")


def test_a_manifest_linking_to_dev_zero_is_refused_at_once(root):
    os.unlink(_path(root))
    os.symlink("/dev/zero", _path(root))
    message = _load_error(root)
    assert "symbolic link inside the checkpoint root" in message


def test_a_fifo_named_like_a_data_file_never_hangs(root):
    doc = json.loads(open(_path(root), "rb").read())
    chunk_file = file_of(doc, row(doc, "a"))
    inside = os.path.join(root, L.step_dir(1), chunk_file)
    os.unlink(inside)
    os.mkfifo(inside)
    _both_refuse(root, r"not a regular file")


def test_a_root_that_cannot_be_created_is_a_storage_error_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match=rf"^{blocker}/root: Not a directory$"):
        ckptd.Checkpointer(str(blocker / "root"), run_id="w").open()
    bad = tmp_path / "ok"
    with ckptd.Checkpointer(str(bad), run_id="w") as c:
        with pytest.raises(StorageError, match="not a path inside the checkpoint root"):
            c.storage.put_atomic("step-1/../../escape", b"x")
        with pytest.raises(StorageError, match="not a path inside the checkpoint root"):
            c.storage.put_atomic("with\x00nul", b"x")


def _resealed(raw: bytes, old: bytes, new: bytes) -> bytes:
    """``raw`` with ``old`` replaced by ``new`` (same length, so the tail length holds), sealed
    again: a well-signed manifest whose index and tensors disagree."""
    assert len(old) == len(new) and raw.count(old) == 1
    body = raw.replace(old, new).split(b'",', 1)[1]  # without its digest
    return seal(b"{" + body)


def test_the_coordinators_one_parse_of_a_manifest_equals_the_lazy_decode(root):
    with open(_path(root), "rb") as f:
        raw = f.read()
    lazy, eager = decode(raw, "m"), decode(raw, "m", eager=True)
    assert eager.tensors.keys() == lazy.tensors.keys() == {"a", "b"}
    for name, e in eager.tensors.items():
        assert (e.dtype_name, e.shape) == (lazy.tensors[name].dtype_name, lazy.tensors[name].shape)
        assert e.chunks == lazy.tensors[name].chunks and e.chunks
    # the tail names a tensor the index does not: refused at once, naming the file
    forged = _resealed(raw, b'"b":{"chunks"', b'"c":{"chunks"')  # in the tail only
    with pytest.raises(CorruptCheckpoint, match=r"^m: the tensors do not match the index$"):
        decode(forged, "m", eager=True)


def test_a_manifest_sealed_for_another_step_than_its_directory_is_refused(root):
    """A manifest whose (well-sealed) step says 2 in ``step-000000001/`` — copied there, or
    rewritten: load, verify and the catalog refuse it, naming both steps, instead of loading
    it as step 1."""
    def other_step(doc):
        doc["step"] = 2

    _tamper(root, other_step)
    _both_refuse(root, r"the manifest is of step 2, in the directory of step 1")
    with pytest.raises(CkptdError, match="the manifest is of step 2"):
        with ckptd.Checkpointer(root, read_only=True) as c:
            c.latest_step()
