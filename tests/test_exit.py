"""A process that ends on an unhandled error (a collective failed: a peer died) with a save in
flight waits ``error_exit_wait_s`` for the other ranks' part, not ``commit_timeout_s``: until it
exits, torchrun restarts nobody. Real interpreters exit here (the drain runs in their exit
hooks), two ranks of one job without a process group (the commit protocol needs none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptd

_RANK = r"""
import os, sys, time, torch, ckptd
root, rank, mode, go = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
agent = os.environ.get("TEST_AGENT") == "1"
torch.set_num_threads(1)
c = ckptd.Checkpointer(root, rank=rank, world_size=2, run_id="r", agent=agent, keep_last=0)
assert (c.executor == "agent") == agent
state = {"w": ckptd.Shard(torch.arange(4096.0) + 4096 * rank, (8192,), (4096 * rank,))}
c.save(state, step=1)
if rank == 1:
    if mode == "dead":
        os._exit(0)  # gone without a word, like a SIGKILL
    while not os.path.exists(go):  # rank 0 began its exit drain
        time.sleep(0.01)
    c.save(state, step=2)
    c.close()
    sys.exit(0)
if mode == "late":  # tell rank 1 once the exit drain has begun
    from ckptd.writer import exiting
    begin = exiting.begin
    def probed(*args, **kwargs):
        begin(*args, **kwargs)
        open(go, "w").close()
    exiting.begin = probed
c.save_async(state, step=2)
raise RuntimeError("all_reduce: Connection closed by peer (rank 1)")
"""


def _start(root: Path, rank: int, mode: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _RANK, str(root), str(rank), mode,
                             str(root.parent / "go")], env=env, stderr=subprocess.PIPE,
                            text=True)


def _run(tmp_path: Path, mode: str, env: dict[str, str], timeout_s: float) -> str:
    root = tmp_path / "root"
    ranks = [_start(root, r, mode, env) for r in (0, 1)]
    try:
        assert ranks[1].wait(timeout=120) == 0, ranks[1].stderr.read()  # type: ignore[union-attr]
        _, err = ranks[0].communicate(timeout=timeout_s)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert ranks[0].returncode == 1, err  # the unhandled error is still the exit status
    assert "Connection closed by peer" in err
    return err


def _latest(root: Path) -> int | None:
    with ckptd.Checkpointer(str(root), rank=0, world_size=1, read_only=True) as c:
        dst = {"w": torch.zeros(8192)}
        step = c.load(dst).step
    assert torch.equal(dst["w"], torch.arange(8192.0))
    return step


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), **extra}


@pytest.mark.parametrize("agent", ["in-process", "node-agent"])
def test_an_error_exit_does_not_wait_out_the_commit_timeout_for_a_dead_rank(
        tmp_path, agent, request):
    if agent == "node-agent":
        request.getfixturevalue("agents")
    # the old drain waited commit_timeout_s (120 s here) for rank 1's share, which never comes
    # (the agent inherits this environment: when the fixture stops it, its own wait for rank 1
    # ends with its 3 s grace window)
    env = _env(CKPTD_COMMIT_TIMEOUT_S="120", CKPTD_ERROR_EXIT_WAIT_S="1", CKPTD_GRACE_S="3",
               TEST_AGENT="1" if agent == "node-agent" else "0")
    err = _run(tmp_path, "dead", env, timeout_s=60)
    said = [line for line in err.splitlines() if "error_exit_wait_s" in line]
    assert len(said) == 1 and "step 2" in said[0], err
    if agent == "in-process":  # the coordinator fails the step, naming who is missing
        assert "ranks [1]" in said[0] and "not committed" in said[0], said
    else:  # the agent, not this process, coordinates; it goes on without the trainer
        assert "node agent goes on" in said[0], said
    assert _latest(tmp_path / "root") == 1  # the previous step stays latest, loads bit-exact


def test_an_error_exit_still_commits_when_the_other_share_arrives_in_the_wait(tmp_path):
    env = _env(CKPTD_COMMIT_TIMEOUT_S="120", CKPTD_ERROR_EXIT_WAIT_S="60", TEST_AGENT="0")
    err = _run(tmp_path, "late", env, timeout_s=100)
    assert "error_exit_wait_s" not in err, err
    assert _latest(tmp_path / "root") == 2
