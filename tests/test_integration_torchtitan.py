"""torchtitan with ckptd as its checkpointer, on real gloo ranks with torchtitan's optimizer,
LR scheduler and dataloader containers (``tests/titan_job.py``): killed on 2 ranks, resumed on
3 bit-exact; torchtitan's own DCP checkpoints resume under ckptd, and ckptd's go back to
torchtitan's DCP manager through ``ckptd export --format dcp``."""

from __future__ import annotations

from typing import Any

import multirank
import pytest
import titan_job
import torch

from ckptd.cli import main

pytestmark = pytest.mark.slow


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _run(fn: Any, world: int, *args: Any) -> list[Any]:
    return multirank.run(fn, world, *args, timeout=240)


def test_a_torchtitan_job_killed_on_2_ranks_resumes_on_3_and_on_2_bit_exact(tmp_path):
    folder, ref = str(tmp_path / "job"), str(tmp_path / "ref")
    with pytest.raises(multirank.RankFailed):
        _run(titan_job.run_and_kill, 2, folder, 4, ref)
    saved = [torch.load(f"{ref}.{r}", weights_only=False) for r in range(2)]
    # on 3 ranks: model, AdamW state (betas too), LR scheduler and train state as saved
    on3 = _run(titan_job.resume, 3, folder, "ckptd", 4, {})
    for state, _ in on3:
        assert _same(state, saved[0]["state"])
    # on 2 ranks the dataloader position comes back too: the next batch is the one the killed
    # run would have drawn, and two more steps match an uninterrupted run bit for bit
    on2 = _run(titan_job.resume, 2, folder, "ckptd", 4, {})
    assert all(torch.equal(batch, saved[r]["next"]) for r, (_, batch) in enumerate(on2))
    reference = _run(titan_job.resume, 2, str(tmp_path / "fresh"), "ckptd", 6, {})
    resumed = _run(titan_job.resume, 2, folder, "ckptd", 6, {})
    assert all(_same(a[0], b[0]) for a, b in zip(resumed, reference, strict=True))


def test_torchtitan_dcp_checkpoints_resume_under_ckptd_on_3_ranks_and_go_back_by_export(
        tmp_path):
    folder = str(tmp_path / "job")
    dcp_run = _run(titan_job.resume, 2, folder, "dcp", 4, {})  # torchtitan's own manager
    moved = _run(titan_job.resume, 3, folder, "ckptd", 4, {"trust_dcp": True})
    for state, _ in moved:
        assert _same(state, dcp_run[0][0])
    on3 = _run(titan_job.resume, 3, folder, "ckptd", 6, {"trust_dcp": True})
    back = str(tmp_path / "back")
    assert main(["export", f"{folder}/checkpoint", "--format", "dcp",
                 "--out", f"{back}/checkpoint/step-6"]) == 0
    # the dp degree changed 3 -> 2: torchtitan's dataloader cannot take the position
    in_titan = _run(titan_job.resume, 2, back, "dcp", 6, {"exclude_from_loading": ["dataloader"]})
    for state, _ in in_titan:
        assert _same(state, on3[0][0])
