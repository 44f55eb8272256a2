"""Read planning and reading: frames touched by a region, coalescing by the gap threshold,
frame-only reads of compressed chunks, the host-memory budget of a load (measured with
tracemalloc and the reader's own counter), the two-pass load and its failure atomicity, and
read-once broadcasting across real ranks."""

from __future__ import annotations

import math
import os
import tracemalloc
from typing import Any

import multirank
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptd
from ckptd import config
from ckptd.loader.load import last_stats
from ckptd.loader.plan import (
    ChunkIndex,
    Read,
    chunk_order,
    coalesce,
    frame_intervals,
    plan_load,
)
from ckptd.manifest import Chunk, FrameTable, Manifest, TensorEntry
from ckptd.manifest import layout as L
from ckptd.regions import Box
from ckptd.sharding import Piece


# --- frames a region touches ----------------------------------------------------------------
def _brute_frames(region: Box, within: Box, itemsize: int, frame_bytes: int) -> set[int]:
    strides = [math.prod(within.sizes[d + 1 :]) for d in range(within.ndim)]
    frames = set()
    for idx in torch.cartesian_prod(*[torch.arange(o, o + s) for o, s in
                                      zip(region.offsets, region.sizes, strict=True)]
                                    ).reshape(-1, region.ndim).tolist():
        flat = sum((i - o) * s for i, o, s in zip(idx, within.offsets, strides, strict=True))
        frames.add(flat * itemsize // frame_bytes)
    return frames


@st.composite
def region_in_chunk(draw: Any) -> tuple[Box, Box, int, int]:
    ndim = draw(st.integers(1, 3))
    sizes = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    offsets = tuple(draw(st.integers(0, 5)) for _ in range(ndim))
    lo = [draw(st.integers(0, s - 1)) for s in sizes]
    hi = [draw(st.integers(a + 1, s)) for a, s in zip(lo, sizes, strict=True)]
    chunk = Box(offsets, sizes)
    region = Box(tuple(o + a for o, a in zip(offsets, lo, strict=True)),
                 tuple(b - a for a, b in zip(lo, hi, strict=True)))
    itemsize = draw(st.sampled_from([1, 2, 4]))
    frame = itemsize * draw(st.integers(1, 12))
    return region, chunk, itemsize, frame


@settings(max_examples=300, deadline=None)
@given(region_in_chunk())
def test_frame_intervals_are_exactly_the_frames_holding_an_element(case: Any) -> None:
    region, chunk, itemsize, frame = case
    got = {f for lo, hi in frame_intervals(region, chunk, itemsize, frame) for f in range(lo, hi)}
    assert got == _brute_frames(region, chunk, itemsize, frame)


def test_a_column_slice_of_long_rows_skips_the_frames_in_between() -> None:
    # rows of 4 frames; the left half of every row is 2 frames: half the chunk is skipped
    chunk = Box((0, 0), (8, 1024))
    assert frame_intervals(Box((0, 0), (8, 512)), chunk, 4, 1024) == \
        [(4 * r, 4 * r + 2) for r in range(8)]


# --- coalescing --------------------------------------------------------------------------------
def _chunk(file: str, offset: int, n: int) -> Chunk:
    return Chunk(Box((0,), (n,)), file, offset, n, "raw", n, FrameTable.of([(n, 0)]), 0)


def _read(file: str, offset: int, n: int) -> Read:
    return Read("t", _chunk(file, offset, n), 1, 0, 1, offset, n)


@st.composite
def chunks_and_box(draw: st.DrawFn) -> tuple[list[Chunk], Box, int]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))

    def box() -> Box:
        offs = [draw(st.integers(0, s - 1)) for s in shape]
        return Box(tuple(offs), tuple(draw(st.integers(0, s - o)) for s, o in zip(
            shape, offs, strict=True)))

    n = draw(st.integers(0, 40))  # below and above ChunkIndex.SMALL
    chunks = [Chunk(box(), "f", 0, 0, "raw", 1, None, draw(st.integers(0, 3))) for _ in range(n)]
    return chunks, box(), draw(st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(chunks_and_box())
def test_the_chunk_index_finds_exactly_the_overlapping_chunks_in_load_order(case: Any) -> None:
    chunks, box, rank = case
    want = [ci for ci in chunk_order(chunks, rank) if chunks[ci].box.intersect(box) is not None]
    assert ChunkIndex(chunks, rank).overlapping(box) == want


def test_ranges_merge_across_gaps_up_to_the_threshold_and_never_across_files() -> None:
    reads = [_read("a", 0, 100), _read("a", 100, 50), _read("a", 250, 10), _read("a", 400, 10),
             _read("b", 160, 10)]
    got = [(r.file, r.start, r.length, len(r.reads)) for r in coalesce(reads, 100, 1 << 20)]
    # 150 -> 250 is a 100-byte gap: merged; 260 -> 400 is 140: not
    assert got == [("a", 0, 260, 3), ("a", 400, 10, 1), ("b", 160, 10, 1)]
    assert [len(r.reads) for r in coalesce(reads, 0, 1 << 20)] == [2, 1, 1, 1]


def test_ranges_stay_within_the_read_unit() -> None:
    reads = [_read("a", i * 100, 100) for i in range(10)]
    assert [r.length for r in coalesce(reads, 0, 300)] == [300, 300, 300, 100]


def _save(root: str, state: dict[str, Any], **kwargs: Any) -> None:
    with ckptd.Checkpointer(root, **kwargs) as ck:
        ck.save(state, step=1)


def test_small_tensors_of_a_file_are_fetched_in_one_range(tmp_path: Any) -> None:
    root = str(tmp_path)
    state = {f"n{i:02d}": torch.full((100,), float(i)) for i in range(20)}
    _save(root, state)
    # 400-byte tensors at 64-byte alignment: 48-byte gaps between them
    for gap, want in ((0, 20), (48, 1), (config.get().gap_bytes, 1)):
        dst = {k: torch.zeros(100) for k in state}
        with config.override(gap_bytes=gap), ckptd.Checkpointer(root, read_only=True) as ck:
            ck.load(dst)
        stats = last_stats()
        assert stats is not None and stats.planned_ranges == want
        assert all(torch.equal(dst[k], state[k]) for k in state)
    # every other tensor (slots of 448 bytes): 10 ranges unless a 496-byte gap is allowed
    half = {k: torch.zeros(100) for k in list(state)[::2]}
    for gap, want in ((495, 10), (496, 1), (config.get().gap_bytes, 1)):
        with config.override(gap_bytes=gap), ckptd.Checkpointer(root, read_only=True) as ck:
            ck.load(half, strict=False)
        assert last_stats().planned_ranges == want  # type: ignore[union-attr]


# --- frame-only reads of compressed chunks ---------------------------------------------------
def test_a_slice_of_a_compressed_chunk_reads_and_decodes_only_its_frames(tmp_path: Any) -> None:
    root = str(tmp_path)
    w = torch.randn(256, 64)  # 64 KiB: 16 frames of 4 KiB (16 rows each)
    with config.override(frame_bytes=4096):
        _save(root, {"w": w}, compression="zstd")
    with ckptd.Checkpointer(root, read_only=True) as ck:
        m = ck.read_manifest(1)
        chunk = m.with_frames([("w", m.tensors["w"].chunks[0])])[0]
        assert chunk.codec == "zstd-planes" and chunk.n_frames == 16
        dst = torch.zeros(20, 64)  # rows 40..59: frames 2 and 3
        res = ck.load({"w": ckptd.Shard(dst, (256, 64), (40, 0))})
    assert torch.equal(dst, w[40:60])
    stats = last_stats()
    assert stats is not None and stats.reads.frames == 2
    assert res.nbytes_read == chunk.frames[2].stored + chunk.frames[3].stored


def test_a_corrupt_frame_outside_the_slice_is_not_read(tmp_path: Any) -> None:
    root = str(tmp_path)
    w = torch.randn(256, 64)
    with config.override(frame_bytes=4096):
        _save(root, {"w": w}, compression="zstd")
    with ckptd.Checkpointer(root, read_only=True) as ck:
        chunk = ck.read_manifest(1).tensors["w"].chunks[0]
    with open(os.path.join(root, L.step_dir(1), chunk.file), "r+b") as f:
        f.seek(chunk.offset + 5)  # frame 0
        f.write(b"\xff\xff")
    dst = torch.zeros(20, 64)
    with ckptd.Checkpointer(root, read_only=True) as ck:
        ck.load({"w": ckptd.Shard(dst, (256, 64), (40, 0))})
        assert torch.equal(dst, w[40:60])
        with pytest.raises(ckptd.CorruptCheckpoint, match="checksum mismatch in frame 0"):
            ck.load({"w": torch.zeros(256, 64)})


# --- the memory budget -------------------------------------------------------------------------
def _big_state(rows: int = 256) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"t{i}": torch.randn(rows, 1024, generator=g) for i in range(4)}


# Python objects of the read plan (reads, copies, boxes): O(pieces x frames), not O(bytes)
PLAN_ALLOWANCE = 256 << 10


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_load_over_budget_holds_at_most_the_budget_of_read_buffers(
    tmp_path: Any, compression: str | None
) -> None:
    """The destination (8 MiB of torch memory) is not on the Python heap; every read buffer
    and decoding temporary is (bytearrays, zstd and numpy output): tracemalloc's peak is the
    reader's memory. It stays within the budget (plus the plan's objects), far below one
    2 MiB tensor, and the reader's own counter agrees."""
    root = str(tmp_path)
    state = _big_state(rows=512)  # 4 x 2 MiB
    with config.override(frame_bytes=64 << 10):
        _save(root, state, compression=compression)
    budget = 512 << 10
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    with config.override(load_budget_bytes=budget, unit_bytes=128 << 10):
        peak = _traced_load(root, dst)
    stats = last_stats()
    assert stats is not None and stats.passes == 2
    assert 0 < stats.peak_buffer_bytes <= budget
    assert peak <= budget + PLAN_ALLOWANCE, f"traced peak {peak} over a budget of {budget}"
    assert all(torch.equal(dst[k], state[k]) for k in state)
    assert stats.needed_bytes == 8 << 20 and stats.reads.frames >= 2 * 128


def _traced_load(root: str, dst: dict[str, torch.Tensor]) -> int:
    """Load ``dst`` from ``root``; the peak of Python-traced memory during the load."""
    with ckptd.Checkpointer(root, read_only=True) as ck:
        tracemalloc.start()
        try:
            ck.load(dst)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()


def test_a_remote_load_reads_larger_ranges_and_still_holds_at_most_the_budget(
    tmp_path: Any
) -> None:
    """On remote storage (any fsspec URL; memory:// here) the read unit is
    ``remote_unit_bytes``, capped at a quarter of the budget: 4 x fewer ranges than a local load
    with the same tunables, and the reader's memory (counted and traced) stays within the budget.
    """
    from ckptd.loader.fetch import Buffers
    from ckptd.loader.load import unit_bytes
    from ckptd.storage import LocalStorage
    from ckptd.storage.fsspec_backend import FsspecStorage

    state = _big_state(rows=512)  # 4 x 2 MiB, one data file
    budget = 2 << 20
    remote = f"memory://remote-unit-{os.getpid()}/run"
    for root in (str(tmp_path), remote):
        with config.override(frame_bytes=64 << 10):
            _save(root, state)
    planned = {}
    with config.override(load_budget_bytes=budget, unit_bytes=128 << 10,
                         remote_unit_bytes=1 << 20):
        buffers = Buffers(budget)
        assert unit_bytes(LocalStorage(str(tmp_path)), buffers) == 128 << 10
        assert unit_bytes(FsspecStorage(remote), buffers) == budget // 4  # capped by the budget
        for root in (str(tmp_path), remote):
            dst = {k: torch.zeros_like(v) for k, v in state.items()}
            peak = _traced_load(root, dst)
            stats = last_stats()
            assert stats is not None and 0 < stats.peak_buffer_bytes <= budget
            assert peak <= budget + PLAN_ALLOWANCE, f"{root}: traced peak {peak} over {budget}"
            assert all(torch.equal(dst[k], state[k]) for k in state)
            planned[root] = stats.planned_ranges
    assert planned == {str(tmp_path): 64, remote: 16}  # 8 MiB in 128 KiB / 512 KiB ranges
    FsspecStorage(remote).remove("")


def test_a_load_within_budget_reads_every_byte_once(tmp_path: Any) -> None:
    root = str(tmp_path)
    state = _big_state()
    _save(root, state)
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    with ckptd.Checkpointer(root, read_only=True) as ck:
        res = ck.load(dst)
    stats = last_stats()
    assert stats is not None and stats.passes == 1
    assert res.nbytes_read == stats.needed_bytes == 4 << 20


def test_a_corrupt_frame_found_in_the_verify_pass_leaves_the_destination_untouched(
    tmp_path: Any
) -> None:
    root = str(tmp_path)
    state = _big_state()
    with config.override(frame_bytes=64 << 10):
        _save(root, state)
    with ckptd.Checkpointer(root, read_only=True) as ck:
        chunk = ck.read_manifest(1).tensors["t3"].chunks[0]  # the last: held, not streamed
    with open(os.path.join(root, L.step_dir(1), chunk.file), "r+b") as f:
        f.seek(chunk.offset + chunk.length - 3)
        f.write(b"\x00\x01\x02")
    dst = {k: torch.full_like(v, -1.0) for k, v in state.items()}
    with config.override(load_budget_bytes=256 << 10), config.override(unit_bytes=64 << 10), \
            ckptd.Checkpointer(root, read_only=True) as ck:
        with pytest.raises(ckptd.CorruptCheckpoint, match=rf"{chunk.file}: t3: checksum"):
            ck.load(dst)
    assert all(bool((v == -1.0).all()) for v in dst.values())


def test_plan_reads_each_element_once_from_overlapping_copies() -> None:
    frames = FrameTable.of([(64, 0)])
    chunks = (Chunk(Box((0,), (16,)), "data/a", 0, 64, "raw", 64, frames, 0),
              Chunk(Box((8,), (16,)), "data/b", 0, 64, "raw", 64, frames, 1))
    m = Manifest(1, "a-1", 2, 0.0, {"t": TensorEntry(torch.float32, (24,), chunks)})
    piece = Piece("t", (24,), torch.float32, Box((4,), (16,)), torch.empty(16))
    for rank, first in ((None, "data/a"), (1, "data/b")):
        plan = plan_load(m, [piece], rank=rank)
        copies = [c for rg in plan.ranges for r in rg.reads for c in r.copies]
        assert sum(c.region.numel for c in copies) == 16
        assert plan.needed_bytes == 64
        by_file = {c.chunk.file: c.region for c in copies}
        assert by_file[first].numel > 0  # the preferred copy is used first


# --- read-once, across ranks -------------------------------------------------------------------
def _read_once_worker(rank: int, world: int, root: str, bad_root: str) -> dict[str, Any]:
    ref = {"shared": torch.arange(4096.0), "own": torch.arange(300.0)}
    out: dict[str, Any] = {}
    with config.override(read_once="on"), ckptd.Checkpointer(root, read_only=True) as ck:
        dst = {"shared": torch.zeros(4096),
               "own": ckptd.Shard(torch.zeros(100), (300,), (100 * rank,))}
        ck.load(dst)
        stats = last_stats()
        assert stats is not None
        out["ok"] = torch.equal(dst["shared"], ref["shared"]) and torch.equal(
            dst["own"].local, ref["own"][100 * rank : 100 * rank + 100])
        out["needed"] = stats.needed_bytes
        out["broadcast"] = stats.broadcast_bytes
    dst = {"shared": torch.full((4096,), -1.0),
           "own": ckptd.Shard(torch.full((100,), -1.0), (300,), (100 * rank,))}
    # rank 2's slice is corrupt: nobody copies
    with ckptd.Checkpointer(bad_root, read_only=True) as ck:
        try:
            ck.load(dst)
            out["error"] = None
        except ckptd.CorruptCheckpoint as e:
            out["error"] = str(e)
    out["untouched"] = bool((dst["shared"] == -1).all() and (dst["own"].local == -1).all())
    return out


def test_read_once_reads_a_replicated_tensor_on_one_rank_and_ranks_agree_on_errors(
    tmp_path: Any
) -> None:
    root, bad = str(tmp_path / "ok"), str(tmp_path / "bad")
    state = {"shared": torch.arange(4096.0), "own": torch.arange(300.0)}
    for r in (root, bad):
        with config.override(frame_bytes=400):
            _save(r, state)
    with ckptd.Checkpointer(bad, read_only=True) as ck:
        chunk = ck.read_manifest(1).tensors["own"].chunks[0]
    with open(os.path.join(bad, L.step_dir(1), chunk.file), "r+b") as f:
        f.seek(chunk.offset + 250 * 4)  # element 250: only rank 2 reads it
        f.write(b"\x00\x00\x80\x7f")
    got = multirank.run(_read_once_worker, 3, root, bad, timeout=120, pg_timeout=30)
    assert [g["ok"] for g in got] == [True] * 3
    # the 16 KiB replicated tensor is read by exactly one rank and broadcast to the others
    assert sum(g["needed"] for g in got) == 4096 * 4 + 300 * 4
    assert sorted(g["broadcast"] for g in got) == [4096 * 4] * 3
    assert got[2]["error"].startswith(f"{bad}/{L.step_dir(1)}/{chunk.file}: own: checksum")
    assert all(g["error"].startswith("load aborted on every rank: rank 2 failed")
               for g in got[:2])
    assert [g["untouched"] for g in got] == [True] * 3


# --- each rank decodes only the manifest entries it asks for -------------------------------
def _subset_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank r asks for tensors t{r}, t{r+3}, ... (strict=False: the others are someone else's)."""
    mine = {f"t{i}": torch.zeros(1000) for i in range(rank, 12, world)}
    with ckptd.Checkpointer(root, read_only=True) as ck:
        result = ck.load(mine, strict=False)
    return {"decoded": result.tensors_decoded, "frames": result.frames_read,
            "ok": all(torch.equal(t, torch.full((1000,), float(int(n[1:]))))
                      for n, t in mine.items())}


def test_ranks_asking_for_disjoint_subsets_each_decode_only_their_own_entries(
    tmp_path: Any
) -> None:
    """Twelve tensors, each one chunk of ten frames; three ranks ask for four each: each
    parses four tensors' chunks and reads forty frames from the frame tables, not twelve and
    a hundred and twenty (what was read, not how long it took)."""
    root = str(tmp_path)
    with config.override(frame_bytes=400, min_frame_bytes=400):
        _save(root, {f"t{i}": torch.full((1000,), float(i)) for i in range(12)})
    got = multirank.run(_subset_worker, 3, root, timeout=120, pg_timeout=30)
    assert [g["ok"] for g in got] == [True] * 3
    assert [g["decoded"] for g in got] == [4, 4, 4]
    assert [g["frames"] for g in got] == [40, 40, 40]


def _strict_worker(rank: int, world: int, root: str) -> str:
    mine = {f"t{i}": torch.zeros(1000) for i in range(rank, 12, world) if i != 7}
    with ckptd.Checkpointer(root, read_only=True) as ck:
        try:
            ck.load(mine, strict="exact")
            return ""
        except ckptd.StateMismatch as e:
            return str(e)


def test_the_strict_check_over_ranks_names_what_no_rank_asked_for(tmp_path: Any) -> None:
    """strict="exact" over three ranks that each ask for a third: the union is checked (one OR of
    a byte per saved tensor), so only t7, which nobody asked for, is named, on every rank."""
    root = str(tmp_path)
    _save(root, {f"t{i}": torch.full((1000,), float(i)) for i in range(12)})
    got = multirank.run(_strict_worker, 3, root, timeout=120, pg_timeout=30)
    assert all("t7: saved but not in the destination state" in g for g in got), got
    assert all("t1:" not in g and "t2:" not in g for g in got), got


# --- the copy pass reads whole frames straight into the destination --------------------------
@pytest.mark.parametrize("transposed", [False, True])
def test_the_copy_pass_reads_frames_into_the_destination_bit_exact(
    tmp_path: Any, transposed: bool
) -> None:
    """Pieces that start and end inside frames (partial frames go through buffers), every
    dtype width, 0-d and bool tensors; ``transposed``: strided destinations (no direct read)."""
    from test_save_load import save_as_ranks

    g = torch.Generator().manual_seed(3)
    ref = {"w": torch.randn(50, 7, generator=g), "h": torch.randn(31, generator=g).half(),
           "b": torch.rand(9, generator=g) > 0.5, "s": torch.tensor(2.5, dtype=torch.float64)}
    with config.override(frame_bytes=64):
        save_as_ranks(str(tmp_path), [
            {"w": ckptd.Shard(ref["w"][:20].clone(), (50, 7), (0, 0)), "h": ref["h"],
             "b": ref["b"], "s": ref["s"]},
            {"w": ckptd.Shard(ref["w"][20:].clone(), (50, 7), (20, 0)), "h": ref["h"],
             "b": ref["b"], "s": ref["s"]}], step=1)
    for lo, hi in ((0, 17), (17, 33), (33, 50)):
        w = torch.zeros(7, hi - lo).t() if transposed else torch.zeros(hi - lo, 7)
        dst = {"w": ckptd.Shard(w, (50, 7), (lo, 0)), "h": torch.zeros(31).half(),
               "b": torch.zeros(9, dtype=torch.bool), "s": torch.tensor(0.0, dtype=torch.float64)}
        with config.override(local_hold_bytes=0), \
                ckptd.Checkpointer(str(tmp_path), read_only=True) as ck:
            ck.load(dst)
        stats = last_stats()
        assert stats is not None and stats.passes == 2 and stats.reread.frames > 0
        assert torch.equal(dst["w"].local, ref["w"][lo:hi])
        assert all(torch.equal(dst[k], ref[k]) for k in ("h", "b", "s"))
