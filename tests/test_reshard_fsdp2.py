"""An FSDP2-shaped checkpoint (every parameter and its Adam state sharded along dim 0 over the
data-parallel ranks, optimizer state named `optim/state/<fqn>/...` as `get_state_dict` names
it): its inferred layout keeps that sharding, so `ckptd reshard --to-world N` writes the source's
bytes once and reads them from storage once, however large N is."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import ckptd
from ckptd import catalog
from ckptd.cli import main
from ckptd.elastic import waves
from ckptd.hostarray import HostArray
from ckptd.loader.infer import infer_layout
from ckptd.loader.targets import Target
from ckptd.regions import Box
from ckptd.storage import LocalStorage
from ckptd.writer.pipeline import runs_within

W, H, LAYERS, VOCAB = 4, 64, 2, 200


def _params() -> dict[str, tuple[int, ...]]:
    out = {"tok_embeddings.weight": (VOCAB, H), "norm.weight": (H,), "output.weight": (VOCAB, H)}
    for i in range(LAYERS):
        out |= {f"layers.{i}.attention.wq.weight": (H, H),
                f"layers.{i}.attention.wo.weight": (H, H),
                f"layers.{i}.feed_forward.w1.weight": (4 * H, H),
                f"layers.{i}.feed_forward.w2.weight": (H, 4 * H),
                f"layers.{i}.attention_norm.weight": (H,)}
    return out


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in _params().items()}


def _state(full: dict[str, torch.Tensor], rank: int, world: int) -> dict:
    def shard(t: torch.Tensor) -> ckptd.Shard:
        per = -(-t.shape[0] // world)
        a = min(t.shape[0], rank * per)
        b = min(t.shape[0], a + per)
        return ckptd.Shard(t[a:b].clone(), tuple(t.shape), (a,) + (0,) * (t.dim() - 1))

    return {"model": {n: shard(t) for n, t in full.items()},
            "optim": {"state": {n: {"exp_avg": shard(t * 0.5), "exp_avg_sq": shard(t * t),
                                    "step": torch.tensor(7.0)} for n, t in full.items()}},
            "step": 7}


def _data_file_bytes(root: str) -> int:
    return sum(f.stat().st_size for f in pathlib.Path(root).rglob("*.bin"))


def _save(root: str) -> None:
    full = _full()
    ranks = [ckptd.Checkpointer(root, rank=r, world_size=W, run_id="fsdp") for r in range(W)]
    handles = [c.save_async(_state(full, r, W)) for r, c in enumerate(ranks)]
    for h in handles:
        h.result()
    for c in ranks:
        c.close()


def test_the_inferred_layout_of_an_fsdp2_checkpoint_keeps_dim_0_sharding_over_dp(tmp_path):
    root = str(tmp_path / "src")
    _save(root)
    spec = infer_layout(catalog.read_manifest(LocalStorage(root), 7))
    by_glob = {g: r for r in spec.rules for g in r.match}
    q = by_glob["*/layers.*.attention.wq.weight"]
    assert q.dp_dim == 0 and "*/layers.*.attention.wq.weight/*" in q.match  # its Adam state too
    assert by_glob["*/norm.weight"].dp_dim == 0
    assert by_glob["*/step"].replicated and by_glob["*/step"].dp_dim is None
    assert [g.match for g in spec.zero.groups] == [("model/*",), ("optim/state/*/*",)]


@pytest.mark.parametrize("flags", [[], ["--zero", "1"], ["--zero", "3"]],
                         ids=["inferred", "zero1", "zero3"])
def test_reshard_of_an_fsdp2_checkpoint_to_many_ranks_costs_its_bytes(tmp_path, capsys, flags):
    """With the inferred layout, and with a ZeRO stage asked for on the command line (the layout
    is then inferred for that stage: flat buffers instead of FSDP2's dim-0 rules)."""
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    _save(src)
    source_bytes = catalog.read_manifest(LocalStorage(src), 7).nbytes
    assert main(["reshard", src, "--to-world", "64", *flags, "--out", out, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    written = sum(r["write_bytes"] for r in report["ranks"])
    assert written == report["nbytes"]
    assert written <= 1.01 * source_bytes, (written, source_bytes, report["ranks"][:3])
    assert report["source_bytes_read"] <= 1.01 * source_bytes
    # on disk, padding adds < 1 %: pieces packed without O_DIRECT padding (64 target ranks of
    # ~3 KiB pieces; a 4 KiB-padded file per rank and 64-byte aligned pieces added 8 %)
    assert _data_file_bytes(out) <= 1.01 * written
    _loads_bit_exact_on_3_ranks(out)


def _loads_bit_exact_on_3_ranks(out: str) -> None:
    """``out`` loads, bit-exact, on another world (3 ranks, the same FSDP2 sharding)."""
    full = _full()
    for r in range(3):
        dst = _state({n: torch.zeros_like(t) for n, t in full.items()}, r, 3)
        with ckptd.Checkpointer(out, rank=r, world_size=3, run_id="reader", read_only=True) as c:
            c.load(dst)
        want = _state(full, r, 3)
        for n in full:
            assert torch.equal(dst["model"][n].local, want["model"][n].local), n
            got_state, want_state = dst["optim"]["state"][n], want["optim"]["state"][n]
            assert torch.equal(got_state["exp_avg_sq"].local, want_state["exp_avg_sq"].local), n


NO_TORCH = """
import sys
class NoTorch:  # any import of torch fails, as if it were not installed
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError(f"{name}: blocked by the test")
sys.meta_path.insert(0, NoTorch())
from ckptd.cli import main
code = main(sys.argv[1:])
sys.exit(code if code else 10 * ("torch" in sys.modules))
"""


@pytest.mark.parametrize("flags", [[], ["--zero", "3", "--compression", "zstd:1"]],
                         ids=["inferred", "zero3-zstd"])
def test_ckptd_reshard_runs_without_torch(tmp_path, flags):
    """The reshard moves bytes: it runs in a process where torch cannot be imported (its
    memory is then the data's, not torch's ~220 MiB), through the wave path (64 thin target
    ranks) and the compressing writer, and what it writes loads bit-exact with torch."""
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    _save(src)
    p = subprocess.run([sys.executable, "-c", NO_TORCH, "reshard", src, "--to-world", "64",
                        *flags, "--out", out], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    _loads_bit_exact_on_3_ranks(out)


@pytest.mark.parametrize("flags", [["--zero", "0"], ["--tp", "2", "--zero", "0"]],
                         ids=["replicated", "tp2-replicated"])
def test_a_layout_that_replicates_writes_each_byte_about_once(tmp_path, capsys, flags):
    """Every target rank holds the whole model (ZeRO 0): the small tensors are copied into
    each rank's files only while the copies stay within 1 % of the bytes; the rest is written
    once, so 64 target ranks cost ~the checkpoint's bytes, not 64 x."""
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    _save(src)
    source_bytes = catalog.read_manifest(LocalStorage(src), 7).nbytes
    assert main(["reshard", src, "--to-world", "64", *flags, "--out", out, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    written = sum(r["write_bytes"] for r in report["ranks"])
    assert source_bytes <= written <= 1.01 * source_bytes, (written, source_bytes)
    full = _full()
    dst = _state({n: torch.zeros_like(t) for n, t in full.items()}, 1, 2)
    with ckptd.Checkpointer(out, rank=1, world_size=2, run_id="reader", read_only=True) as c:
        c.load(dst)
    want = _state(full, 1, 2)
    for n in full:
        assert torch.equal(dst["model"][n].local, want["model"][n].local), n


def test_target_ranks_are_grouped_in_waves_of_consecutive_ranks_under_the_bound() -> None:
    # a rank above the bound is alone (read straight into its arena); the others fill waves
    assert runs_within([10, 10, 100, 10, 10, 10], 25) == [[0, 1], [2], [3, 4], [5]]
    assert runs_within([], 1) == []


def test_a_wave_reads_the_hull_of_adjacent_slices_and_the_boxes_of_scattered_ones() -> None:
    """Rows split over ranks: one region per tensor (their hull); two corners of a tensor: the
    hull would be larger than the boxes, so each box is its own region. Every piece views the
    region that holds it, at its place."""
    full = HostArray(torch.arange(40.0).reshape(10, 4).numpy().view(np.uint32), "float32")

    def target(name: str, rows: tuple[int, int], cols: tuple[int, int] = (0, 4)) -> Target:
        return Target(name, (10, 4), "float32",
                      Box((rows[0], cols[0]), (rows[1] - rows[0], cols[1] - cols[0])))

    slices = [target("w", (0, 3)), target("w", (3, 6)), target("w", (6, 10))]
    corners = [target("c", (0, 2), (0, 2)), target("c", (8, 10), (2, 4))]
    empty = Target("e", (0, 4), "float32", Box((0, 0), (0, 4)))
    regions = waves.Regions.of([*slices, *corners, empty])
    assert list(regions.by_name["w"]) == [Box((0, 0), (10, 4))]
    assert list(regions.by_name["c"]) == [t.box for t in corners]
    assert "e" not in regions.by_name and regions.nbytes >= (40 + 8) * 4
    for piece in regions.pieces():  # what the read fills: the global tensor at each region
        piece.view.copy_(full[piece.box.within(Box((0, 0), (10, 4)))])
    for t in [*slices, *corners]:
        p = regions.piece(t)
        assert p.box == t.box and np.array_equal(
            p.view.numpy(), full[t.box.within(Box((0, 0), (10, 4)))].numpy())
    assert regions.piece(empty).view.shape == (0, 4)


def _with_replicated(state: dict) -> dict:
    """The FSDP2 state plus small tensors every rank holds whole (a rotary table, a scale), as
    its 0-d Adam ``step`` per parameter already is."""
    state["buffers"] = {"freqs": torch.arange(48, dtype=torch.float32) / 7,
                        "scale": torch.tensor([3.0, -1.5], dtype=torch.bfloat16)}
    return state


def _manifest_bytes(root: str) -> int:
    return pathlib.Path(root, "step-000000007", "manifest.json").stat().st_size


@pytest.mark.parametrize("world", [8, 64])
def test_a_replicated_tensor_is_written_once_whatever_the_target_world(tmp_path, world):
    """Every target rank holds each 0-d Adam step and each replicated buffer whole: the
    reshard writes each of them once (one chunk every target rank reads, as a save at that
    world records it), so they add nothing that grows with the target world, and the result
    loads bit-exact on target ranks (FSDP2's dim-0 layout has a chunk per target rank of each
    sharded tensor, as a save at that world has)."""
    full = _full()
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    ranks = [ckptd.Checkpointer(src, rank=r, world_size=W, run_id="fsdp") for r in range(W)]
    for h in [c.save_async(_with_replicated(_state(full, r, W))) for r, c in enumerate(ranks)]:
        h.result()
    for c in ranks:
        c.close()
    ckptd.reshard(src, world, out=out, threads=2)
    m = catalog.read_manifest(LocalStorage(out), 7)
    replicated = [n for n in m.tensors if n.endswith("/step") or n.startswith("buffers/")]
    assert len(replicated) == len(full) + 2
    chunks = {n: len(m.tensors[n].chunks) for n in replicated}
    assert chunks == dict.fromkeys(replicated, 1), chunks
    for r in sorted({0, 1, world // 2, world - 1}):  # the target world's own sharding
        dst = _with_replicated(_state({n: torch.zeros_like(t) for n, t in full.items()}, r,
                                      world))
        for n in full:
            dst["optim"]["state"][n]["step"] = torch.tensor(0.0)
        dst["buffers"] = {k: torch.zeros_like(v) for k, v in dst["buffers"].items()}
        with ckptd.Checkpointer(out, rank=r, world_size=world, run_id="reader",
                                read_only=True) as c:
            c.load(dst)
        want = _with_replicated(_state(full, r, world))
        for n in full:
            got_state, want_state = dst["optim"]["state"][n], want["optim"]["state"][n]
            assert torch.equal(dst["model"][n].local, want["model"][n].local), (r, n)
            assert torch.equal(got_state["exp_avg"].local, want_state["exp_avg"].local), (r, n)
            assert torch.equal(got_state["step"], want_state["step"]), (r, n)
        for k, v in want["buffers"].items():
            assert dst["buffers"][k].dtype == v.dtype and torch.equal(dst["buffers"][k], v), k


def _ddp_state(full: dict[str, torch.Tensor]) -> dict:
    return _with_replicated({
        "model": dict(full),
        "optim": {"state": {n: {"exp_avg": t * 0.5, "exp_avg_sq": t * t,
                                "step": torch.tensor(7.0)} for n, t in full.items()}},
        "step": 7})


def test_a_replicated_model_resharded_to_64_ranks_keeps_its_manifest_small(tmp_path):
    """A data-parallel checkpoint (every tensor whole on every rank: the save wrote each
    once) resharded for 64 ranks that each hold all of it: one chunk per tensor, a manifest
    within 2x the source's, and each target rank loads it bit-exact."""
    full = _full()
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    ranks = [ckptd.Checkpointer(src, rank=r, world_size=W, run_id="ddp") for r in range(W)]
    for h in [c.save_async(_ddp_state(full)) for c in ranks]:
        h.result()
    for c in ranks:
        c.close()
    ckptd.reshard(src, 64, out=out, threads=2)
    m = catalog.read_manifest(LocalStorage(out), 7)
    chunks = {n: len(e.chunks) for n, e in m.tensors.items()}
    assert chunks == dict.fromkeys(m.tensors, 1), chunks
    assert _manifest_bytes(out) <= 2 * _manifest_bytes(src), (_manifest_bytes(out),
                                                              _manifest_bytes(src))
    want = _ddp_state(full)
    for r in (0, 1, 63):
        dst = _ddp_state({n: torch.zeros_like(t) for n, t in full.items()})
        for n in full:
            dst["optim"]["state"][n]["step"] = torch.tensor(0.0)
        dst["buffers"] = {k: torch.zeros_like(v) for k, v in dst["buffers"].items()}
        with ckptd.Checkpointer(out, rank=r, world_size=64, run_id="reader",
                                read_only=True) as c:
            c.load(dst)
        for n in full:
            assert torch.equal(dst["model"][n], want["model"][n]), (r, n)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                got, exp = dst["optim"]["state"][n][k], want["optim"]["state"][n][k]
                assert torch.equal(got, exp), (r, n, k)
        for k, v in want["buffers"].items():
            assert dst["buffers"][k].dtype == v.dtype and torch.equal(dst["buffers"][k], v), k
