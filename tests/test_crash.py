"""Crash consistency: a save SIGKILLed at any point never leaves a step that loads wrong data,
and the root always loads the newest complete step bit-exactly."""

from __future__ import annotations

import multiprocessing as mp
import random
import signal

import torch
from faulty_storage import KillAtOp

import ckptd
from ckptd import config

N = 1 << 15


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"a": torch.randn(N, generator=g), "b": torch.randn(64, 64, generator=g)},
        "step": step,
    }


def _child(root: str, step: int, kill_at: int) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    with config.override(min_file_bytes=1 << 14):
        c = ckptd.Checkpointer(
            root, run_id=f"run-{step}", storage=KillAtOp(root, kill_at), threads=2, keep_last=2
        )
        c.save(_state(step))
        c.close()


def _load_latest(root: str) -> tuple[int, dict]:
    dst = {"model": {"a": torch.zeros(N), "b": torch.zeros(64, 64)}, "step": -1}
    with ckptd.Checkpointer(root, run_id="reader") as c:
        step = c.load(dst).step
    return step, dst


def test_sigkill_at_random_points_never_breaks_the_latest_checkpoint(tmp_path):
    root = str(tmp_path / "root")
    rng = random.Random(1234)
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_child, args=(root, 0, 10**9))  # a clean first checkpoint
    p.start()
    p.join()
    assert p.exitcode == 0
    committed = 0
    kills = 0
    for step in range(1, 21):
        p = ctx.Process(target=_child, args=(root, step, rng.randint(1, 9)))
        p.start()
        p.join()
        assert p.exitcode in (0, -signal.SIGKILL), p.exitcode
        kills += p.exitcode == -signal.SIGKILL
        loaded, dst = _load_latest(root)
        # Either the killed save got far enough to be complete (then it is finalised and must
        # be exactly that step), or the previous newest step is still the one that loads.
        assert loaded in (committed, step), (loaded, committed, step)
        expect = _state(loaded)
        assert dst["step"] == loaded
        assert torch.equal(dst["model"]["a"], expect["model"]["a"])
        assert torch.equal(dst["model"]["b"], expect["model"]["b"])
        committed = loaded
    assert kills >= 10  # the schedule really did kill most saves
