"""torch.optim state keyed by parameter name, through torch.distributed.checkpoint.state_dict:
a plain model, DDP and FSDP2, saved on one world and resumed on another."""

from __future__ import annotations

import multirank
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptd


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(sd: dict) -> dict:
    """Materialise DTensors (FSDP2) for comparison."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _full(v)
        elif hasattr(v, "full_tensor"):
            out[k] = v.full_tensor()
        else:
            out[k] = v
    return out


def _assert_same(a: dict, b: dict, path: str = "") -> None:
    assert a.keys() == b.keys(), (path, sorted(a), sorted(b))
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k], f"{path}/{k}")
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{path}/{k}"
        else:
            assert a[k] == b[k], f"{path}/{k}"


def test_plain_model_and_adam_state_round_trip_by_parameter_name(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3, seed=1)
    msd, osd = get_state_dict(model, opt)
    assert "0.weight" in osd["state"]  # keyed by FQN, not by parameter index
    with ckptd.Checkpointer(str(tmp_path)) as c:
        c.save({"model": msd, "optim": osd, "step": 3})
        model2 = _model()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
        msd2, osd2 = get_state_dict(model2, opt2)  # initialises empty Adam state to fill
        c.load({"model": msd2, "optim": osd2, "step": 0})
        set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    _assert_same(dict(get_state_dict(model, opt)[1]), dict(get_state_dict(model2, opt2)[1]))
    _train(model, opt, 2, seed=9)
    _train(model2, opt2, 2, seed=9)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def _ddp_save(rank: int, world: int, root: str) -> None:
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3, seed=1)
    msd, osd = get_state_dict(model, opt)  # FQNs without the "module." prefix
    with ckptd.Checkpointer(root) as c:
        c.save({"model": msd, "optim": osd, "step": 3})


def _fsdp2(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _fsdp2_load_and_compare(rank: int, world: int, root: str, expect: dict) -> None:
    model, opt = _fsdp2(world)
    msd, osd = get_state_dict(model, opt)
    with ckptd.Checkpointer(root) as c:
        c.load({"model": msd, "optim": osd, "step": 0})
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    got_m, got_o = get_state_dict(model, opt)
    _assert_same(_full(dict(got_m)), expect["model"])
    _assert_same(_full(dict(got_o))["state"], expect["optim"]["state"])
    dist.barrier()


def _fsdp2_save(rank: int, world: int, root: str) -> dict:
    model, opt = _fsdp2(world)
    _train(model, opt, 3, seed=1)
    msd, osd = get_state_dict(model, opt)
    with ckptd.Checkpointer(root) as c:
        c.save({"model": msd, "optim": osd, "step": 3})
    full = {"model": _full(dict(msd)), "optim": {"state": _full(dict(osd))["state"]}}
    return full


def test_ddp_state_on_two_ranks_loads_into_a_plain_model(tmp_path):
    root = str(tmp_path)
    multirank.run(_ddp_save, 2, root)
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train(reference, ref_opt, 3, seed=1)  # DDP averages identical grads: same trajectory
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    with ckptd.Checkpointer(root) as c:
        c.load({"model": msd, "optim": osd, "step": 0})
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_fsdp2_state_saved_on_four_ranks_resumes_on_two(tmp_path):
    root = str(tmp_path)
    full = multirank.run(_fsdp2_save, 4, root)[0]
    multirank.run(_fsdp2_load_and_compare, 2, root, full)
