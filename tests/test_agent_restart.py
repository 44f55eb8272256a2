"""A restart on rank 0's node while its agent still coordinates the old run's last step, one
rank's share of which never comes (``ckptd/agent/orphans.py``): the agent asks the job's other
agents, and fails the step at once when none writes or awaits the share — so the restart does
not wait ``CKPTD_AGENT_DRAIN_S`` for it; while one may still come, it keeps waiting and commits
— also when the restart reuses its predecessor's run id (the agent tells incarnations apart).

Two simulated nodes (a: rank 0, b: rank 1), each with its own agent; real trainer processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import pytest
import torch
from agent_procs import alive, fork_ranks, reap, wait_until
from test_agent import _expected, _latest, _load, _state

import ckptd
from ckptd.manifest import layout

_DRAIN_S = "60"  # a restart that waits it out is caught by the count it returns, not by time


def _first_run(root: str, rank: int, node: str, conn) -> None:
    """Step 1 on both ranks; step 2 handed to node a's agent by rank 0 only. Rank 1 waits to
    be told to save its share of step 2 (or is killed first)."""
    torch.set_num_threads(1)
    os.environ["CKPTD_NODE_ID"] = node
    c = ckptd.Checkpointer(root, rank=rank, world_size=2, run_id="first", agent=True,
                           keep_last=0)
    assert c.executor == "agent", "no agent"
    c.save(_state(1, rank), step=1)
    if rank == 0:
        c.save_async(_state(2, rank), step=2)  # its agent commits step 2, once rank 1's is in
    conn.send("saved")
    if conn.recv() == "save":
        c.save(_state(2, rank), step=2)
        conn.send("committed")
        conn.recv()


def _start(root: str, a: str, b: str) -> list:
    procs = fork_ranks(_first_run, lambda r: (root, r, (a, b)[r]), 2)
    for _, parent in procs:
        assert parent.poll(120) and parent.recv() == "saved"
    return procs


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), 10, f"process {pid} to die")


def _second_run(root: str, caplog: pytest.LogCaptureFixture, run_id: str = "second") -> list[str]:
    """The restarted job's Checkpointer on node a (it drains the agent first); what it warned."""
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        ckptd.Checkpointer(root, rank=0, world_size=1, run_id=run_id, agent=True).open().close()
    return [r.getMessage() for r in caplog.records if "still runs" in r.getMessage()]


def _failed(root: str, step: int) -> list[str]:
    d = os.path.join(root, layout.step_dir(step), "ranks")
    out = []
    for attempt in os.listdir(d):
        path = os.path.join(d, attempt, layout.FAILED)
        if os.path.exists(path):
            with open(path) as f:
                out.append(json.load(f)["message"])
    return out


@pytest.mark.parametrize("lost", ["node b", "rank 1's trainer"])
def test_a_restart_fails_the_old_step_whose_missing_share_no_agent_holds(
        tmp_path, agents, monkeypatch, caplog, lost):
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    monkeypatch.setenv("CKPTD_AGENT_DRAIN_S", _DRAIN_S)
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    procs = _start(root, a, b)
    try:
        (t0, _), (t1, _) = procs
        _kill(t1.pid)  # before its share of step 2
        if lost == "node b":
            _kill(agents.pid(b))  # its agent too
        _kill(t0.pid)  # torchrun stops the survivors before it restarts them
        # the drain ended with no job left: none waited out
        assert _second_run(root, caplog) == []
    finally:
        reap(procs)
    [reason] = _failed(root, 2)
    assert "ranks [1]" in reason and "run first was restarted" in reason, reason
    if lost == "node b":
        assert f"nodes ['{b}'] do not answer" in reason, reason
    assert _latest(root) == 1
    step, dst = _load(root)
    assert step == 1 and torch.equal(dst["model"]["w"], _expected(1))


@pytest.mark.parametrize("run_id", ["second", "first"])  # "first": the restart reuses the id
def test_a_restart_waits_for_a_share_whose_trainer_is_still_connected(
        tmp_path, agents, monkeypatch, caplog, run_id):
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    monkeypatch.setenv("CKPTD_AGENT_DRAIN_S", _DRAIN_S)
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    procs = _start(root, a, b)
    warned: list[list[str]] = []
    restart = threading.Thread(target=lambda: warned.append(_second_run(root, caplog, run_id)))
    try:
        (t0, _), (t1, c1) = procs
        _kill(t0.pid)
        # rank 1's trainer lives on (a node that left the job, still saving after its SIGTERM)
        restart.start()
        wait_until(lambda: "still waiting for ranks [1]" in agents.log(), 60,
                   "node a's agent to hear that node b serves rank 1's trainer")
        assert f"node {b} serves the trainers of ranks [1]" in agents.log()
        assert restart.is_alive()  # its drain waits for the step
        c1.send("save")
        assert c1.poll(120) and c1.recv() == "committed"
        c1.send("exit")
        restart.join(120)
    finally:
        reap(procs)
    assert warned == [[]]  # the step committed; the drain ended with no job left
    assert _failed(root, 2) == []
    step, dst = _load(root)
    assert step == 2 and torch.equal(dst["model"]["w"], _expected(2))


def _late_run(root: str, rank: int, node: str, conn) -> None:
    """A restarted job's trainer: rank 0 saves each step when told and reports its commit;
    rank 1 (whose node's agent the test kills: it saves in process) saves only once rank 0's
    agent is waiting for its share."""
    torch.set_num_threads(1)
    os.environ["CKPTD_NODE_ID"] = node
    c = ckptd.Checkpointer(root, rank=rank, world_size=2, run_id="second", agent=True,
                           keep_last=0)
    conn.send("ready")
    while (msg := conn.recv()) != "exit":
        step = int(msg)
        if rank == 0:
            h = c.save_async(_state(step, rank), step=step)
            conn.send("staged")
            try:
                h.result()
                conn.send("committed")
            except ckptd.CkptdError as e:
                conn.send(f"failed: {e}")
        else:
            try:
                c.save(_state(step, rank), step=step)
                conn.send("committed")
            except ckptd.CkptdError as e:
                conn.send(f"failed: {e}")
    c.close()


def _partial_of_rank_0(root: str, step: int) -> bool:
    d = os.path.join(root, layout.step_dir(step), "ranks")
    return os.path.isdir(d) and any(
        os.path.exists(os.path.join(d, a, os.path.basename(layout.partial_path(step, a, 0))))
        for a in os.listdir(d))


def test_after_a_restart_a_late_share_of_the_current_run_is_waited_for(tmp_path, agents,
                                                                       monkeypatch):
    """Two nodes with a job secret; the job restarts after step 1 (the first run drained on
    node a's agent); in the second run node b's agent dies and rank 1 saves in process, its
    share coming after rank 0's agent is already waiting: steps 2-4 all commit (before, the
    agent took the current run for a superseded one and failed each step at once)."""
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    procs = _start(root, a, b)  # the first run: step 1 committed, step 2 staged on rank 0
    try:
        (t0, c0), (t1, c1) = procs
        c1.send("save")  # rank 1's share of step 2: the first run ends cleanly
        assert c1.poll(120) and c1.recv() == "committed"
        c1.send("exit")
        c0.send("exit")
        for p, _ in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        reap(procs)
    second = fork_ranks(_late_run, lambda r: (root, r, (a, b)[r]), 2)
    try:
        for _, parent in second:
            assert parent.poll(120) and parent.recv() == "ready"
        _kill(agents.pid(b))  # rank 1's agent: it saves in process from now on
        (_, c0), (_, c1) = second
        for step in (3, 4, 5):
            c0.send(str(step))
            assert c0.poll(120) and c0.recv() == "staged"
            # rank 0's agent writes its share and waits for rank 1's
            wait_until(lambda s=step: _partial_of_rank_0(root, s), 60, f"rank 0's step {step}")
            c1.send(str(step))
            assert c1.poll(120) and c1.recv() == "committed", f"step {step}"
            assert c0.poll(120) and c0.recv() == "committed", f"step {step}"
        for _, parent in second:
            parent.send("exit")
        for p, _ in second:
            p.join(60)
    finally:
        reap(second)
    assert all(_failed(root, s) == [] for s in (3, 4, 5))
    step, dst = _load(root)
    assert step == 5 and torch.equal(dst["model"]["w"], _expected(5))
