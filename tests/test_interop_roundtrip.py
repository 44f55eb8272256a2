"""DCP -> ckptd -> DCP gives back the same checkpoint: every tensor bit-exact, every non-tensor
value equal by ``==`` and by type (tuples, bytes, ints), per-rank byte entries where DCP keeps
them; the step of a torchtitan-style directory is carried over."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import multirank
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptd
from ckptd.cli import main


def _fsdp2_state(rank: int, world: int) -> tuple[Any, Any, dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optimizer": osd}


def _save_like_torchtitan(rank: int, world: int, path: str) -> None:
    _, _, state = _fsdp2_state(rank, world)
    state["dataloader"] = {f"dp_rank_{rank}": pickle.dumps({"rank": rank, "pos": 11}),
                           "world_size": world}
    state["train_state"] = {"step": 7, "ntokens_seen": 3584}
    state["lr_scheduler"] = {"last_epoch": 7, "base_lrs": [0.01], "_is_initial": False}
    dcp.save(state, checkpoint_id=path)
    dist.barrier()


def _same(a: Any, b: Any, where: str, out: list[str]) -> None:
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
            out.append(f"{where}: tensors differ")
        return
    if type(a) is not type(b):
        out.append(f"{where}: {type(a).__name__} became {type(b).__name__}")
        return
    if isinstance(a, dict):
        if set(a) != set(b):
            out.append(f"{where}: keys {sorted(set(a) ^ set(b))} differ")
        for k in set(a) & set(b):
            _same(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: length {len(a)} became {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _same(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append(f"{where}: {a!r} became {b!r}")


def test_dcp_to_ckptd_to_dcp_of_fsdp2_and_adamw_is_equal_by_value_and_type(tmp_path, capsys):
    src = tmp_path / "tt" / "step-7"
    multirank.run(_save_like_torchtitan, 2, str(src))
    assert main(["import-dcp", str(src), "--out", str(tmp_path / "root"), "--trust"]) == 0
    said = capsys.readouterr().out
    assert "as step 7 (from the directory name step-7)" in said and "skipped" not in said
    out = tmp_path / "back"
    assert main(["export", str(tmp_path / "root"), "--format", "dcp", "--out", str(out)]) == 0
    dcp_to_torch_save(str(src), str(tmp_path / "a.pt"))
    dcp_to_torch_save(str(out), str(tmp_path / "b.pt"))
    a = torch.load(tmp_path / "a.pt", weights_only=False)
    b = torch.load(tmp_path / "b.pt", weights_only=False)
    problems: list[str] = []
    _same(a, b, "state", problems)
    assert problems == []
    assert type(b["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert b["dataloader"]["dp_rank_1"] == pickle.dumps({"rank": 1, "pos": 11})


def _load_imported(rank: int, world: int, root: str) -> tuple[Any, ...]:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, _ = _fsdp2_state(rank, world)
    fresh = torch.optim.AdamW(model.parameters())  # betas (0.9, 0.999), no state yet
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, fresh)
    with ckptd.Checkpointer(root, read_only=True) as ck:
        state = {"model": msd, "optimizer": osd, "train_state": {"step": 0}}
        ck.load(state, strict=False)
    set_state_dict(model, fresh, model_state_dict=msd, optim_state_dict=osd)
    return fresh.param_groups[0]["betas"], state["train_state"]["step"]


def test_an_imported_checkpoint_restores_the_saved_betas_on_load(tmp_path):
    src = tmp_path / "step-7"
    multirank.run(_save_like_torchtitan, 2, str(src))
    assert main(["import-dcp", str(src), "--out", str(tmp_path / "root"), "--trust"]) == 0
    got = multirank.run(_load_imported, 3, str(tmp_path / "root"))
    assert got == [((0.8, 0.95), 7)] * 3


def test_the_step_of_an_import_comes_from_the_flag_the_name_or_train_state(tmp_path, capsys):
    state = {"w": torch.ones(2), "train_state": {"step": 12}}
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    dcp.save(state, checkpoint_id=str(tmp_path / "step-30"), no_dist=True)
    for args, said in [
        (["plain"], "as step 12 (from the value train_state/step)"),
        (["step-30"], "as step 30 (from the directory name step-30)"),
        (["step-30", "--step", "5"], "as step 5 (from --step)"),
    ]:
        root = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        assert main(["import-dcp", str(tmp_path / args[0]), "--out", str(root), "--trust",
                     *args[1:]]) == 0
        assert said in capsys.readouterr().out
        with ckptd.Checkpointer(str(root), read_only=True) as ck:
            assert ck.latest_step() == int(said.split()[2])
    assert Path(tmp_path / "plain").is_dir()


def _load_full(rank: int, world: int, root: str) -> dict[str, Any]:
    """The FSDP2 model's and AdamW's state loaded from ``root`` on this world, gathered whole."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, _ = _fsdp2_state(rank, world)
    msd, osd = get_state_dict(model, opt)
    for t in [*msd.values(), *(v for s in osd["state"].values() for v in s.values())]:
        t.zero_()
    with ckptd.Checkpointer(root, read_only=True) as ck:
        ck.load({"model": msd, "optimizer": osd}, strict=False)
    return {"model": {k: v.full_tensor() for k, v in msd.items()},
            "optimizer": {k: {n: v.full_tensor() if hasattr(v, "full_tensor") else v
                              for n, v in s.items()} for k, s in osd["state"].items()}}


def test_reshard_of_an_imported_fsdp2_checkpoint_keeps_it_sharded_and_says_why(tmp_path, capsys):
    src, root, out = tmp_path / "step-7", str(tmp_path / "root"), str(tmp_path / "on3")
    multirank.run(_save_like_torchtitan, 2, str(src))
    assert main(["import-dcp", str(src), "--out", root, "--trust"]) == 0
    capsys.readouterr()
    assert main(["reshard", root, "--to-world", "3", "--out", out, "--json"]) == 0
    said = capsys.readouterr()
    report = json.loads(said.out)
    assert ("layout from the source: parameters and optimizer state were saved sharded along "
            "dim 0 (FSDP2) over 2 ranks; each target rank holds dim-0 shards") in said.err
    # each of the 3 target ranks holds about a third, not the whole state (ZeRO 0's replicas)
    held = [r["hold_bytes"] for r in report["ranks"]]
    assert max(held) < 0.5 * report["nbytes"], held
    dcp_to_torch_save(str(src), str(tmp_path / "a.pt"))
    saved = torch.load(tmp_path / "a.pt", weights_only=False)
    for got in multirank.run(_load_full, 3, out):
        for k, v in got["model"].items():
            assert torch.equal(v, saved["model"][k]), k
        for k, s in got["optimizer"].items():
            assert torch.equal(s["exp_avg_sq"], saved["optimizer"]["state"][k]["exp_avg_sq"]), k
