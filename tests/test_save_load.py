"""Single-process save/load: every leaf kind, values, per-rank values, strict checks."""

from __future__ import annotations

import math

import pytest
import torch

import ckptd
from ckptd.manifest import layout as L


def save_as_ranks(url, states, step):
    """Simulate a world of len(states) ranks in one process: no collectives are needed to save."""
    ckpts = [
        ckptd.Checkpointer(url, rank=r, world_size=len(states), run_id="sim")
        for r in range(len(states))
    ]
    handles = [c.save_async(s, step=step) for c, s in zip(ckpts, states, strict=True)]
    results = [h.result() for h in handles]
    for c in ckpts:
        c.close()
    return results


@pytest.fixture
def ckpt(tmp_path):
    with ckptd.Checkpointer(str(tmp_path / "root")) as c:
        yield c


def _ref():
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(6, 10, generator=g),
        "v": torch.randn(7, generator=g).to(torch.bfloat16),
        "i": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "s": torch.tensor(3.5, dtype=torch.float64),
        "m": torch.tensor([True, False, True]),
    }


def test_plain_tensors_values_and_training_round_trip(ckpt):
    ref = _ref()
    state = {
        "model": {k: v.clone() for k, v in ref.items()},
        "step": 7,
        "loader": {"consumed": 1234, "seed": 5, "name": "c4", "frac": 0.25, "none": None},
        "empty": {},
    }
    res = ckpt.save(state, training={"global_batch": 64})
    assert res.step == 7
    dst = {
        "model": {k: torch.zeros_like(v) for k, v in ref.items()},
        "step": 0,
        "loader": {"consumed": 0, "seed": 0, "name": "", "frac": 0.0, "none": 1},
        "empty": {},
    }
    out = ckpt.load(dst)
    assert out.step == 7
    assert out.training == {"global_batch": 64}
    for k, v in ref.items():
        assert torch.equal(dst["model"][k], v), k
    assert dst["step"] == 7
    assert dst["loader"] == {"consumed": 1234, "seed": 5, "name": "c4", "frac": 0.25, "none": None}


def test_the_checkpoint_holds_the_values_at_the_time_of_the_call(ckpt):
    w = torch.ones(1000)
    h = ckpt.save_async({"w": w}, step=1)
    w.fill_(2.0)  # modify right after save_async returned
    h.result()
    dst = {"w": torch.zeros(1000)}
    ckpt.load(dst, step=1)
    assert torch.equal(dst["w"], torch.ones(1000))


def test_flat_shards_load_into_boxes_and_back(ckpt):
    ref = _ref()
    members = [("w", (6, 10)), ("v", (7,))]
    flat = torch.cat([ref["w"].reshape(-1), torch.zeros(7)])  # float32 buffer for w + v slot
    # three uneven flat shards with 5 elements of padding at the end
    padded = torch.cat([flat, torch.full((5,), -7.0)])
    cuts = [0, 13, 50, padded.numel()]
    save_as_ranks(
        ckpt.url,
        [
            {"o": {"buf": ckptd.FlatShard(padded[lo:hi].clone(), members, lo)}}
            for lo, hi in zip(cuts, cuts[1:], strict=False)
        ],
        step=3,
    )
    # load the same logical tensors as boxes
    dst_w = torch.full((3, 10), float("nan"))
    dst_v = torch.full((7,), float("nan"))
    ckpt.load({"o": {"w": ckptd.Shard(dst_w, (6, 10), (3, 0)), "v": dst_v}}, step=3, strict=False)
    assert torch.equal(dst_w, ref["w"][3:6])
    assert torch.equal(dst_v, torch.zeros(7))


def test_fused_parts_are_separate_logical_tensors(ckpt):
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    parts = [
        ("q", (4, 3), (0, 0), (4, 3)),
        ("k", (2, 3), (0, 0), (2, 3)),
        ("v", (2, 3), (0, 0), (2, 3)),
    ]
    ckpt.save({"attn": {"qkv": ckptd.Fused(torch.cat([q, k, v]), 0, parts)}}, step=1)
    dst = {"attn": {"q": torch.zeros(4, 3), "k": torch.zeros(2, 3), "v": torch.zeros(2, 3)}}
    ckpt.load(dst)
    assert torch.equal(dst["attn"]["q"], q)
    assert torch.equal(dst["attn"]["k"], k)
    assert torch.equal(dst["attn"]["v"], v)


def test_padded_vocabulary_rows_are_neither_saved_nor_read(ckpt):
    vocab, hidden = 13, 4
    ref = torch.randn(vocab, hidden)
    # TP=2, vocab padded to 14: rank 1's local tensor has one padding row
    padded = [ref[0:7].clone(), torch.cat([ref[7:13], torch.full((1, hidden), 99.0)])]
    save_as_ranks(
        ckpt.url,
        [
            {"emb": ckptd.Shard(padded[r][: min(7, vocab - 7 * r)], (vocab, hidden), (7 * r, 0))}
            for r in range(2)
        ],
        step=1,
    )
    m = ckpt.read_manifest(1)
    assert m.tensors["emb"].shape == (13, 4)
    assert sum(c.length for c in m.tensors["emb"].chunks) == 13 * 4 * 4
    dst = torch.full((7, hidden), -1.0)
    ckpt.load({"emb": ckptd.Shard(dst[:6], (vocab, hidden), (7, 0))})
    assert torch.equal(dst[:6], ref[7:13])
    assert torch.equal(dst[6], torch.full((hidden,), -1.0))  # padding row untouched


def test_local_values_come_back_per_rank(ckpt):
    rng = torch.get_rng_state()
    ckpt.save({"rng": ckptd.Local(rng.clone()), "seed": ckptd.Local({"s": 3})}, step=2)
    dst = {"rng": ckptd.Local(torch.zeros_like(rng)), "seed": ckptd.Local({"s": 0})}
    ckpt.load(dst)
    assert torch.equal(dst["rng"].value, rng)
    assert dst["seed"].value == {"s": 3}


def test_compressed_checkpoints_round_trip_with_partial_frame_reads(tmp_path):
    from ckptd import config

    with config.override(frame_bytes=4096):
        with ckptd.Checkpointer(str(tmp_path), compression="zstd:3") as c:
            w = torch.randn(300, 100).to(torch.bfloat16)
            c.save({"w": w}, step=1)
            m = c.read_manifest(1)
            assert {ch.codec for ch in m.tensors["w"].chunks} == {"zstd-planes"}
            assert m.tensors["w"].chunks[0].n_frames == math.ceil(300 * 100 * 2 / 4096)
            dst = torch.zeros(50, 100, dtype=torch.bfloat16)
            res = c.load({"w": ckptd.Shard(dst, (300, 100), (120, 0))})
            assert torch.equal(dst, w[120:170])
            (chunk,) = m.with_frames([("w", m.tensors["w"].chunks[0])])
            assert res.nbytes_read < chunk.table.total / 2


def test_step_defaults_to_state_step_then_last_plus_one(ckpt):
    assert ckpt.latest_step() is None
    assert ckpt.save({"x": torch.ones(1), "step": 5}).step == 5
    assert ckpt.save({"x": torch.ones(1)}).step == 6
    assert ckpt.latest_step() == 6
    with open(f"{ckpt.url}/{L.LATEST}") as f:
        assert f.read() == "step-000000006"


def test_keep_last_never_removes_the_newest(tmp_path):
    with ckptd.Checkpointer(str(tmp_path), keep_last=2) as c:
        for s in range(5):
            c.save({"x": torch.full((4,), float(s))}, step=s)
    # retention runs after each commit; close() (end of the with-block) drained it
    assert [int(n[5:]) for n in sorted(p.name for p in tmp_path.glob("step-*"))] == [3, 4]
    with ckptd.Checkpointer(str(tmp_path), keep_last=1) as c:
        dst = {"x": torch.zeros(4)}
        c.load(dst)
        assert torch.equal(dst["x"], torch.full((4,), 4.0))
        c.save({"x": torch.full((4,), 5.0)}, step=5)
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-000000005"]


def test_small_chunks_get_smaller_frames_so_a_resharding_cut_over_reads_little(tmp_path):
    from ckptd import config

    big, small = torch.randn(1024, 1024), torch.randn(257, 256)  # 4 MiB and 257 KiB chunks
    scaled = {"frame_bytes": 64 << 10, "min_frame_bytes": 4 << 10, "frames_per_chunk": 64}
    with config.override(**scaled):
        with ckptd.Checkpointer(str(tmp_path / "adaptive")) as c:
            c.save({"big": big, "small": small}, step=1)
            tensors = c.read_manifest(1).tensors
    assert [tensors[n].chunks[0].frame_bytes for n in ("big", "small")] == [64 << 10, 4 << 10]
    assert tensors["small"].chunks[0].n_frames == -(-257 * 1024 // (4 << 10))
    with config.override(**{**scaled, "min_frame_bytes": 64 << 10}):  # fixed frames
        with ckptd.Checkpointer(str(tmp_path / "fixed")) as c:
            c.save({"small": small}, step=1)
            assert c.read_manifest(1).tensors["small"].chunks[0].frame_bytes == 64 << 10

    # a rank of a 3-way split needs rows 86..171: it reads them plus at most a frame per cut
    with ckptd.Checkpointer(str(tmp_path / "adaptive")) as c:
        dst = torch.zeros(86, 256)
        r = c.load({"small": ckptd.Shard(dst, (257, 256), (86, 0))}, strict=False)
    assert torch.equal(dst, small[86:172])
    assert dst.numel() * 4 <= r.nbytes_read <= dst.numel() * 4 + 2 * (4 << 10)


def test_a_load_keeps_no_reference_to_its_destinations(tmp_path):
    """The load plan holds no reference cycle: a destination is freed when the caller drops it,
    without waiting for the garbage collector (an export streams slabs through the loader)."""
    import gc
    import weakref

    w = torch.randn(300, 100)
    with ckptd.Checkpointer(str(tmp_path / "r")) as c:
        c.save({"w": w, "b": torch.randn(10)}, step=1)
        gc.disable()
        try:
            dst = {"w": torch.zeros(300, 100), "b": torch.zeros(10)}
            ref = weakref.ref(dst["w"])
            c.load(dst)
            assert torch.equal(dst["w"], w)
            del dst
            assert ref() is None
        finally:
            gc.enable()


def test_the_local_backend_writes_again_into_a_directory_it_removed(tmp_path):
    """LocalStorage remembers the directories it made; removing one must forget it."""
    from ckptd.storage.local import LocalStorage

    storage = LocalStorage(str(tmp_path / "r"))
    storage.write_file("step/data/x", [b"1234"])
    storage.remove("step")  # what gc and retention do
    storage.write_file("step/data/y", [b"5678"])
    storage.put_atomic("step/data/z", b"9")
    assert storage.list_dir("step/data") == ["y", "z"]
