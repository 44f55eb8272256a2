"""The node agent that runs rank 0's job tells the node's other ranks their save committed
(``ckptd.agent.commits``): their trainers neither wait for the manifest nor tell the agent they
saw it. Where rank 0's job was not in the agent when a rank's job ended, the trainer waits as
before. Both ranks are Checkpointers of this process, each with its own session of one real
agent."""

from __future__ import annotations

import glob

import torch
from agent_procs import count_commit_waits, two_agent_ranks, wait_until

import ckptd
from ckptd.agent import wire


def _state(rank: int, step: int) -> dict[str, object]:
    return {"w": ckptd.Shard(torch.full((8,), float(10 * step + rank)), (16,), (8 * rank,))}


def _running(agents) -> int:  # type: ignore[no-untyped-def]
    return int(wire.request(agents.paths["sock"], {"op": "status"}, timeout_s=10.0)
               ["saves_running"])


def test_the_ranks_of_the_coordinating_node_learn_the_commit_from_their_agent(
        tmp_path, agents, monkeypatch):
    root = str(tmp_path / "root")
    calls = count_commit_waits(monkeypatch)
    with two_agent_ranks(root) as (c0, c1):
        for step in (1, 2):
            # the previous step's jobs have ended (they count as running until after the reply)
            wait_until(lambda: _running(agents) == 0, 60, "the agent to finish its jobs")
            h0 = c0.save_async(_state(0, step), step=step)  # its job waits for rank 1's share
            wait_until(lambda: _running(agents) == 1, 60, "rank 0's job to run in the agent")
            c1.save(_state(1, step), step=step)
            h0.result()
    assert calls == {"waited": 0, "told": 0}
    with ckptd.Checkpointer(root, agent=False) as c:
        got = {"w": torch.zeros(16)}
        c.load(got, step=2)
    assert torch.equal(got["w"], torch.tensor([20.0] * 8 + [21.0] * 8))


def test_a_rank_whose_job_ends_before_rank_0_s_arrives_waits_for_the_commit_itself(
        tmp_path, agents, monkeypatch):
    root = str(tmp_path / "root")
    calls = count_commit_waits(monkeypatch)
    with two_agent_ranks(root) as (c0, c1):
        h1 = c1.save_async(_state(1, 1), step=1)
        wait_until(lambda: glob.glob(f"{root}/step-000000001/ranks/*/00001.json"), 60,
                   "rank 1's partial")
        wait_until(lambda: calls["waited"] == 1, 60, "rank 1 to wait for the commit itself")
        c0.save(_state(0, 1), step=1)
        h1.result()
    assert calls == {"waited": 1, "told": 1}


def test_a_waiting_rank_is_answered_by_the_thread_that_ends_rank_0_s_job():
    """``Commits.when_ended``: the reply of a rank that waits for rank 0's job runs in the
    thread that ends that job, with its outcome; at once when it has ended; not at all (False)
    when no rank-0 job of the attempt arrived."""
    import threading

    from ckptd.agent.commits import Commits

    commits = Commits()
    calls: list[tuple[str, bool]] = []

    def record(committed: bool) -> None:
        calls.append((threading.current_thread().name, committed))

    assert not commits.when_ended(("r", 1, "a-1"), record)  # no rank 0 job here
    ok, failed = commits.expect(("r", 1, "a-1")), commits.expect(("r", 2, "a-2"))
    assert commits.when_ended(("r", 1, "a-1"), record)
    assert commits.when_ended(("r", 2, "a-2"), record)
    assert calls == []  # rank 0's jobs still run
    enders = [threading.Thread(target=ok.set_result, args=(True,), name="rank-0-job-1"),
              threading.Thread(target=failed.set_result, args=(False,), name="rank-0-job-2")]
    for t in enders:
        t.start()
        t.join()
    assert calls == [("rank-0-job-1", True), ("rank-0-job-2", False)]
    assert commits.when_ended(("r", 1, "a-1"), record)  # ended already: here, at once
    assert calls[-1] == (threading.current_thread().name, True)
