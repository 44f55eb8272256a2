"""Partial loads keep the missing-key check: by default everything the destination asks for
must be in the checkpoint, and what the checkpoint holds beyond that is left alone (an
evaluation job loads only the model); ``strict="exact"`` checks both ways."""

from __future__ import annotations

import pytest
import torch

import ckptd


def _training_state(v: float) -> dict:
    return {"model": {"w": torch.full((16, 4), v), "b": torch.full((4,), v)},
            "optim": {"m": torch.full((16, 4), -v), "v": torch.full((4,), -v)},
            "step": 5}


def _model_only() -> dict:
    return {"model": {"w": torch.zeros(16, 4), "b": torch.zeros(4)}}


@pytest.fixture
def root(tmp_path):
    with ckptd.Checkpointer(str(tmp_path)) as c:
        c.save(_training_state(3.0), step=5)
    return str(tmp_path)


def test_an_evaluation_job_loads_only_the_model_by_default(root):
    dst = _model_only()
    with ckptd.Checkpointer(root, read_only=True) as c:
        assert c.load(dst).step == 5
    assert torch.equal(dst["model"]["w"], torch.full((16, 4), 3.0))
    assert torch.equal(dst["model"]["b"], torch.full((4,), 3.0))
    ckptd.init(root, read_only=True)
    try:
        dst = _model_only()
        assert ckptd.load(dst).step == 5
        assert torch.equal(dst["model"]["b"], torch.full((4,), 3.0))
    finally:
        ckptd.close()


def test_a_missing_key_still_fails_in_one_line_naming_it_and_touches_nothing(root):
    dst = _model_only()
    dst["model"]["extra"] = torch.full((2,), -1.0)
    with ckptd.Checkpointer(root, read_only=True) as c, \
            pytest.raises(ckptd.StateMismatch) as info:
        c.load(dst)
    message = str(info.value)
    assert "model/extra: missing from the checkpoint" in message and "\n" not in message
    assert "optim" not in message  # saved and not asked for: not a problem by default
    assert torch.equal(dst["model"]["w"], torch.zeros(16, 4))
    assert torch.equal(dst["model"]["extra"], torch.full((2,), -1.0))


def test_strict_exact_also_fails_on_what_the_destination_does_not_ask_for(root):
    dst = _model_only()
    with ckptd.Checkpointer(root, read_only=True) as c:
        with pytest.raises(ckptd.StateMismatch) as info:
            c.load(dst, strict="exact")
        message = str(info.value)
        assert "optim/m: saved but not in the destination state (strict='exact')" in message
        assert "\n" not in message and torch.equal(dst["model"]["w"], torch.zeros(16, 4))
        with pytest.raises(ValueError, match="strict must be True, False or 'exact'"):
            c.load(dst, strict="both")  # type: ignore[arg-type]
        full = _training_state(0.0)
        assert c.load(full, strict="exact").step == 5
        assert torch.equal(full["optim"]["v"], torch.full((4,), -3.0))


def test_a_dcp_checkpoint_loads_a_subset_by_default_and_checks_both_ways_when_exact(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptd.interop import load_dcp

    path = str(tmp_path / "dcp")
    dcp.save(_training_state(2.0), checkpoint_id=path, no_dist=True)
    dst = _model_only()
    load_dcp(dst, path, trust=True)
    assert torch.equal(dst["model"]["w"], torch.full((16, 4), 2.0))
    dst = _model_only()
    with pytest.raises(ckptd.StateMismatch, match=r"optim/m: saved but not in the destination"):
        load_dcp(dst, path, trust=True, strict="exact")
    assert torch.equal(dst["model"]["w"], torch.zeros(16, 4))
