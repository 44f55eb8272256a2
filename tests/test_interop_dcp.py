"""torch.distributed.checkpoint directories as a load source and as an import source.

The source of the main tests is written by ``torch.distributed.checkpoint.save`` itself, on 4
gloo ranks, from the DTensor layout of ``transformer_state`` (a (dp=2, tp=2) mesh, uneven and
2-d sharded tensors, replicated norms). It is loaded on 3 ranks into every ckptd leaf kind.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import multirank
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)
import transformer_state as ts
from transformer_state import LAYOUTS, Layout, build_state

import ckptd
import ckptd.checkpointer
import ckptd.config
from ckptd.cli import main
from ckptd.errors import CheckpointNotFound, CorruptCheckpoint, StateMismatch
from ckptd.interop import UntrustedPickle, load_dcp
from ckptd.regions import Box
from ckptd.sharding import LOCAL_PREFIX, Local, describe

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SOURCE = "dtensor_dp2_tp2"
# 3-rank destinations: FlatShard (dict members) + Fused + Shard + plain tensors; params in
# FlatShards too, two buckets; DTensors on a 3-rank mesh (uneven splits).
TARGETS = {
    "dp3_zero1": LAYOUTS["dp3_zero1"],
    "dp3_zero3": Layout("dp3_zero3", dp=3, zero=3, buckets=2),
    "dtensor_dp3": LAYOUTS["dtensor_dp3"],
}


def dcp_state(state: dict[str, Any]) -> dict[str, Any]:
    """What a DCP user would save: everything but ckptd's per-rank ``Local`` leaves."""
    return {k: v for k, v in state.items() if not isinstance(v, Local)}


def _dcp_save(rank: int, world: int, path: str) -> None:
    dcp.save(
        dcp_state(build_state(LAYOUTS[SOURCE], rank, ts.reference()).state), checkpoint_id=path
    )


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("dcp") / "step-7")
    multirank.run(_dcp_save, 4, path, timeout=120)
    assert sorted(os.listdir(path)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    return path


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def problems_after_load(layout: Layout, rank: int, dst: Any) -> list[str]:
    """Differences from the reference; padding, ``Local`` values must be as they were."""
    world = layout.world_size
    ref = ts.reference()
    out = []
    for p in describe(dst.state, rank, world).pieces:
        if p.name.startswith(LOCAL_PREFIX):
            continue
        if not same_bits(p.view, ref[p.name][p.box.within(Box.whole(tuple(ref[p.name].shape)))]):
            out.append(f"{p.name} {p.box}: differs from the reference")
    expected = build_state(layout, rank, ref, padding=ts.SENTINEL)
    for path, buf in dst.buffers.items():
        if path == "rng":
            if not same_bits(buf, torch.zeros_like(buf)):
                out.append("Local rng: changed although DCP has no per-rank values")
            continue
        pad = torch.isnan(expected.buffers[path])
        if not bool(torch.isnan(buf[pad]).all()):
            out.append(f"{path}: padding overwritten")
    got = {
        "step": dst.state["step"],
        "optim/step": dst.state["optim"]["step"],
        "meta": dst.state["meta"],
        "data": dst.state["data"].value,
    }
    want = {
        "step": ts.STEP,
        "optim/step": ts.OPTIM_STEP,
        "meta": {"layout": SOURCE, "lr": 3e-4},
        "data": ts.BLANK_DATA_POSITION,
    }
    out += [f"{k}: {got[k]!r}, want {want[k]!r}" for k in want if got[k] != want[k]]
    return [f"{layout.name} rank {rank}: {line}" for line in out]


def _load_every_target(rank: int, world: int, path: str) -> list[str]:
    problems = []
    for target, layout in TARGETS.items():
        dst = build_state(layout, rank, None)
        if target == "dtensor_dp3":  # through the Checkpointer hook, on a DCP root
            with (
                ckptd.config.override(load_budget_bytes=1),  # decode pass, then copy pass
                ckptd.Checkpointer(path, rank=rank, world_size=world, keep_last=0) as ck,
            ):
                result = ck.load(dst.state, trust=True)  # a DCP root: the source plug-in
        else:
            result = load_dcp(dst.state, path, trust=True)
        assert result is not None and result.step == ts.STEP, result
        problems += problems_after_load(layout, rank, dst)
    return problems


def test_dcp_saved_on_four_ranks_loads_on_three_into_every_leaf_kind_bit_exact(dcp_dir):
    per_rank = multirank.run(_load_every_target, 3, dcp_dir, timeout=120)
    problems = [line for lines in per_rank for line in lines]
    assert problems == []


def test_import_dcp_writes_a_ckptd_checkpoint_that_loads_resharded(dcp_dir, tmp_path, capsys):
    dest = str(tmp_path / "ckpt")
    assert main(["import-dcp", dcp_dir, "--out", dest, "--trust", "--compression", "zstd"]) == 0
    out = capsys.readouterr().out
    assert f"as step {ts.STEP} (from the directory name step-7): {dest}/step-{ts.STEP:09d}" in out
    assert main(["verify", dest]) == 0
    for layout in (LAYOUTS["single"], LAYOUTS["dp3_zero1"]):
        for rank in range(layout.world_size):  # each rank's share, one process at a time
            dst = build_state(layout, rank, None)
            with ckptd.Checkpointer(
                dest, rank=rank, world_size=layout.world_size, run_id="check", keep_last=0
            ) as ck:
                assert ck.load(dst.state, strict=True).step == ts.STEP
            assert problems_after_load(layout, rank, dst) == []
    capsys.readouterr()
    assert main(["import-dcp", dcp_dir, "--out", dest, "--trust"]) == 2
    assert "already a ckptd root (owner.json); import into a new root" in capsys.readouterr().err


def small_dcp(path: Path, **writer: Any) -> dict[str, Any]:
    """A one-process DCP checkpoint (one data file); returns what it saved."""
    sd = {"model": {"w": torch.randn(13, 8), "b": torch.arange(5)}, "step": 3, "lr": [0.1, 0.2]}
    storage_writer = dcp.FileSystemWriter(str(path), **writer)
    dcp.save(sd, storage_writer=storage_writer, no_dist=True)
    return sd


def fresh() -> dict[str, Any]:
    return {
        "model": {"w": torch.full((13, 8), -1.0), "b": torch.full((5,), -1)},
        "step": 0,
        "lr": [0.0, 0.0],
    }


def assert_untouched(state: dict[str, Any]) -> None:
    assert torch.equal(state["model"]["w"], torch.full((13, 8), -1.0))
    assert torch.equal(state["model"]["b"], torch.full((5,), -1))
    assert state["step"] == 0 and state["lr"] == [0.0, 0.0]


def test_reading_dcp_metadata_needs_trust_and_says_why(tmp_path, capsys):
    small_dcp(tmp_path / "d")
    state = fresh()
    with pytest.raises(
        UntrustedPickle,
        match=r"d/\.metadata: DCP metadata is a Python pickle, "
        r"and unpickling can run any code .* pass trust=True \(CLI: --trust\)",
    ):
        load_dcp(state, str(tmp_path / "d"))
    assert_untouched(state)
    assert main(["import-dcp", str(tmp_path / "d"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptd import-dcp: error: ") and "--trust" in err
    assert err.count("\n") == 1 and not (tmp_path / "c").exists()


def test_a_zstd_transformed_dcp_loads_and_values_fill_list_elements(tmp_path):
    from torch.distributed.checkpoint._extension import ZStandard

    sd = small_dcp(tmp_path / "z", _extensions=[ZStandard()])
    state = fresh()
    result = load_dcp(state, str(tmp_path / "z"), trust=True)
    assert result.step == 3 and result.nbytes_read > 0
    assert torch.equal(state["model"]["w"], sd["model"]["w"])
    assert torch.equal(state["model"]["b"], sd["model"]["b"])
    assert state["lr"] == [0.1, 0.2]  # one DCP object, two ckptd leaves


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda d: (d / ".metadata").write_bytes(b"not a pickle"),
            r"\.metadata: not a readable pickle",
        ),
        (
            lambda d: (d / ".metadata").write_bytes(pickle.dumps({"a": 1})),
            r"\.metadata: holds a dict, not DCP Metadata",
        ),
        (lambda d: (d / "__0_0.distcp").unlink(), r"__0_0\.distcp: data file missing"),
        (lambda d: os.truncate(d / "__0_0.distcp", 100), r"__0_0\.distcp: data file truncated"),
        (
            lambda d: (d / "__0_0.distcp").write_bytes(b"x" * 20000),
            r"__0_0\.distcp: \S+: item at byte \d+ (is not a saved tensor|does not load)",
        ),
    ],
    ids=["garbage-metadata", "foreign-pickle", "missing-distcp", "truncated", "garbage-distcp"],
)
def test_bad_dcp_input_is_one_line_naming_the_file_and_touches_nothing(tmp_path, damage, message):
    small_dcp(tmp_path / "d")
    damage(tmp_path / "d")
    state = fresh()
    with pytest.raises(CorruptCheckpoint, match=message) as info:
        load_dcp(state, str(tmp_path / "d"), trust=True)
    assert "\n" not in str(info.value)
    assert_untouched(state)


def test_a_directory_without_metadata_is_not_dcp(tmp_path):
    with pytest.raises(CheckpointNotFound, match="not a torch.distributed.checkpoint directory"):
        load_dcp(fresh(), str(tmp_path), trust=True)


def test_layout_and_key_mismatches_are_listed_before_anything_is_touched(tmp_path):
    small_dcp(tmp_path / "d")
    state = fresh()
    state["model"]["w"] = torch.full((12, 8), -1.0)
    state["model"]["extra"] = torch.zeros(2)
    state["gone"] = 1
    with pytest.raises(StateMismatch) as info:
        load_dcp(state, str(tmp_path / "d"), trust=True)
    msg = str(info.value)
    assert "model/w: saved shape (13, 8), destination (12, 8)" in msg
    assert "model/extra: missing from the checkpoint" in msg
    assert "gone: value missing from the checkpoint" in msg
    assert torch.equal(state["model"]["b"], torch.full((5,), -1)) and state["step"] == 0
    del state["model"]["w"], state["model"]["extra"], state["gone"]
    with pytest.raises(StateMismatch, match=r"model/w: saved but not in the destination state"):
        load_dcp(state, str(tmp_path / "d"), trust=True, strict="exact")
    assert load_dcp(state, str(tmp_path / "d"), trust=True, strict=False).step == 3


def _missing_on_one_rank(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(40.0).view(10, 4)
    dcp.save({"w": distribute_tensor(w, mesh, [Shard(0)], src_data_rank=None)}, checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        os.unlink(os.path.join(path, "__1_0.distcp"))  # only rank 1's rows are in it
    dist.barrier()
    local = torch.full((5, 4), -1.0)
    with pytest.raises(CorruptCheckpoint) as info:
        load_dcp({"w": ckptd.Shard(local, (10, 4), (5 * rank, 0))}, path, trust=True)
    return type(info.value).__name__, str(info.value), bool((local == -1).all())


def test_a_file_only_one_rank_needs_fails_the_load_on_every_rank_untouched(tmp_path):
    got = multirank.run(_missing_on_one_rank, 2, str(tmp_path / "d"), timeout=60, pg_timeout=20)
    assert got[1][1].endswith("d/__1_0.distcp: data file missing")
    assert got[0][1].startswith("load aborted on every rank: rank 1 failed: ")
    assert got[0][1].endswith("d/__1_0.distcp: data file missing")
    assert [untouched for _, _, untouched in got] == [True, True]


def test_ckptd_load_accepts_a_dcp_directory_as_source(tmp_path):
    sd = small_dcp(tmp_path / "d")
    ckptd.init(str(tmp_path / "new-root"))
    try:
        state = fresh()
        with pytest.raises(UntrustedPickle):
            ckptd.load(state, source=str(tmp_path / "d"))  # type: ignore[call-arg]
        assert ckptd.load(state, source=str(tmp_path / "d"), trust=True).step == 3  # type: ignore[call-arg]
        assert torch.equal(state["model"]["w"], sd["model"]["w"])
    finally:
        ckptd.checkpointer.default().close()
        ckptd.checkpointer.set_default(None)
    shutil.rmtree(tmp_path / "new-root")


@pytest.mark.parametrize("rank, world", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_world_is_refused_before_anything_is_read(tmp_path, rank, world):
    """load_dcp resolves rank and world size as a Checkpointer does, range check included."""
    small_dcp(tmp_path / "d")
    state = fresh()
    with pytest.raises(ckptd.CkptdError, match=rf"^rank {rank} outside world of size {world}$"):
        load_dcp(state, str(tmp_path / "d"), trust=True, rank=rank, world_size=world)
    assert_untouched(state)
