"""Stateful objects in the state tree: a model, its optimizer, an LR scheduler or any object
with ``state_dict()``/``load_state_dict()`` is saved and loaded as it is (``ckptd.stateful``)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptd


class Counter:
    """A user's own stateful object: a JSON value and a tensor."""

    def __init__(self) -> None:
        self.seen, self.total = 0, torch.zeros(3)
        self.loads = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen, "total": self.total.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.seen, self.total = sd["seen"], sd["total"].clone()
        self.loads += 1


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)
    assert sa["param_groups"] == sb["param_groups"]


def test_a_model_optimizer_scheduler_and_own_object_round_trip_as_they_are(tmp_path):
    model, opt, sched = _trained(0)
    counter = Counter()
    counter.seen, counter.total = 7, torch.arange(3.0)
    with ckptd.Checkpointer(str(tmp_path), rank=0, world_size=1) as ck:
        ck.save({"model": model, "optim": opt, "sched": sched, "counter": counter, "step": 3})
        names = set(ck.read_manifest(3).tensors)
        # keyed as get_state_dict keys them: by parameter name
        msd, osd = get_state_dict(model, opt)
        assert {f"model/{k}" for k in msd} <= names
        assert {f"optim/state/{k}/exp_avg" for k in osd["state"]} <= names
        new_model, new_opt, new_sched = _fresh()
        new_counter = Counter()
        state = {"model": new_model, "optim": new_opt, "sched": new_sched,
                 "counter": new_counter, "step": 0}
        assert ck.load(state).step == 3
    assert state["step"] == 3  # values come back into the caller's dict
    assert state["model"] is new_model and state["optim"] is new_opt  # objects stay objects
    for (k, v), (k2, v2) in zip(model.state_dict().items(), new_model.state_dict().items(),
                                strict=True):
        assert k == k2 and torch.equal(v, v2), k
    _same_optim(opt, new_opt)
    assert new_sched.state_dict() == sched.state_dict()
    assert new_counter.loads == 1 and new_counter.seen == 7
    assert torch.equal(new_counter.total, torch.arange(3.0))


def test_optimizers_pair_with_the_module_that_owns_their_parameters(tmp_path):
    a, opt_a, _ = _trained(1)
    b, opt_b, _ = _trained(2)
    with ckptd.Checkpointer(str(tmp_path), rank=0, world_size=1) as ck:
        # keys that say nothing: pairing is by parameter identity
        ck.save({"x": opt_b, "y": a, "z": b, "w": opt_a}, step=1)
        fa, fopt_a, _ = _fresh()
        fb, fopt_b, _ = _fresh()
        ck.load({"x": fopt_b, "y": fa, "z": fb, "w": fopt_a})
    _same_optim(opt_a, fopt_a)
    _same_optim(opt_b, fopt_b)


def test_a_failed_load_leaves_every_object_as_it_was(tmp_path):
    model, opt, sched = _trained(0)
    with ckptd.Checkpointer(str(tmp_path), rank=0, world_size=1) as ck:
        ck.save({"model": model, "optim": opt, "sched": sched, "counter": Counter()}, step=1)
        wrong = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 3))  # another head: shapes differ
        wrong_opt = torch.optim.AdamW(wrong.parameters(), lr=1e-2)
        new_sched = torch.optim.lr_scheduler.StepLR(wrong_opt, step_size=2, gamma=0.5)
        counter = Counter()
        before = {k: v.clone() for k, v in wrong.state_dict().items()}
        sched_before = new_sched.state_dict()
        with pytest.raises(ckptd.StateMismatch, match="model/2.weight"):
            ck.load({"model": wrong, "optim": wrong_opt, "sched": new_sched,
                     "counter": counter})
    for k, v in wrong.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not wrong_opt.state  # the state created to be filled is gone again
    assert all(p.grad is None for p in wrong.parameters())
    assert new_sched.state_dict() == sched_before
    assert counter.loads == 0
