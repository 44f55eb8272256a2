"""A rank's save smaller than ``$CKPTD_AGENT_MIN_BYTES`` (default 1 MiB) is written by its own
process even where the node agent runs; a larger one goes to the agent. The ranks of one step
may be written by either: the commit goes through storage. Ranks are Checkpointers of this
process, each with its own session of one real agent (conftest.py sets the variable to 0 for
the rest of the suite; these tests set it themselves)."""

from __future__ import annotations

import json

import pytest
import torch
from agent_procs import count_commit_waits, two_agent_ranks, wait_until

import ckptd
from ckptd.agent import wire
from ckptd.errors import CkptdError

SMALL, LARGE = 8, 4096  # float32 elements a rank: 32 bytes, 16 KiB


def _state(rank: int, step: int, n0: int, n1: int) -> dict[str, object]:
    """An uneven split: rank 0 has the first ``n0`` elements, rank 1 the ``n1`` after."""
    n, offset = (n0, 0) if rank == 0 else (n1, n0)
    return {"w": ckptd.Shard(torch.full((n,), float(10 * step + rank)), (n0 + n1,), (offset,))}


def _status(agents) -> dict:  # type: ignore[no-untyped-def]
    return wire.request(agents.paths["sock"], {"op": "status"}, timeout_s=10.0)


def _loaded(root: str, step: int, n0: int, n1: int) -> torch.Tensor:
    with ckptd.Checkpointer(root, agent=False, read_only=True) as c:
        got = {"w": torch.zeros(n0 + n1)}
        c.load(got, step=step, strict=False)
    return got["w"]


def test_by_default_a_save_under_1_mib_is_written_in_process_and_a_larger_one_by_the_agent(
        tmp_path, agents, monkeypatch):
    monkeypatch.delenv("CKPTD_AGENT_MIN_BYTES")
    root = str(tmp_path / "root")
    small = {"w": torch.arange(1000, dtype=torch.float32)}  # 4 kB
    large = {"w": torch.arange(300_000, dtype=torch.float32)}  # 1.2 MB
    with ckptd.Checkpointer(root, agent=True) as c:
        assert c.executor == "agent"
        first = c.save(small, step=1)
        assert first.executor == "process"
        assert _status(agents)["memory_used"] == 0  # no arena of it in the agent
        second = c.save(large, step=2)
        assert second.executor == "agent"
        assert _status(agents)["memory_used"] >= large["w"].nbytes  # it keeps the step
        third = c.save(small, step=3)
        assert third.executor == "process"
    metrics = [json.loads(line) for line in (tmp_path / "root" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [(m["step"], m["executor"]) for m in metrics] == [
        (1, "process"), (2, "agent"), (3, "process")]
    for step, want in ((1, small), (2, large), (3, small)):
        with ckptd.Checkpointer(root, agent=False, read_only=True) as c:
            got = {"w": torch.zeros_like(want["w"])}
            c.load(got, step=step)
        assert torch.equal(got["w"], want["w"])


@pytest.mark.parametrize("rank_0", ["in process", "in the agent"])
def test_a_step_whose_ranks_are_written_by_the_agent_and_in_process_commits(
        tmp_path, agents, monkeypatch, rank_0):
    monkeypatch.setenv("CKPTD_AGENT_MIN_BYTES", "8KiB")  # (staged in 4 KiB blocks)
    calls = count_commit_waits(monkeypatch)
    root = str(tmp_path / "root")
    n0, n1 = (SMALL, LARGE) if rank_0 == "in process" else (LARGE, SMALL)
    with two_agent_ranks(root) as (c0, c1):
        for step in (1, 2):
            h0 = c0.save_async(_state(0, step, n0, n1), step=step)  # waits for rank 1's partial
            r1 = c1.save(_state(1, step, n0, n1), step=step)
            r0 = h0.result()
            assert (r0.executor, r1.executor) == (
                ("process", "agent") if rank_0 == "in process" else ("agent", "process"))
            got = _loaded(root, step, n0, n1)
            assert torch.equal(got, torch.cat([torch.full((n0,), 10.0 * step),
                                               torch.full((n1,), 10.0 * step + 1)]))
        assert c0.latest_step() == 2
    # rank 1 waited for each commit itself; it told the agent of a commit only where the
    # agent wrote its share (the agent keeps that step until it hears)
    assert calls == ({"waited": 2, "told": 2} if rank_0 == "in process"
                     else {"waited": 2, "told": 0})
    wait_until(lambda: _status(agents)["saves_running"] == 0, 60, "the agent's jobs to end")


def test_zero_sends_every_save_to_the_agent(tmp_path, agents, monkeypatch):
    monkeypatch.setenv("CKPTD_AGENT_MIN_BYTES", "0")
    with ckptd.Checkpointer(str(tmp_path / "root"), agent=True) as c:
        assert c.save({"w": torch.ones(1)}, step=1).executor == "agent"


def test_a_bad_value_is_an_error_naming_the_variable(tmp_path, agents, monkeypatch):
    monkeypatch.setenv("CKPTD_AGENT_MIN_BYTES", "lots")
    with pytest.raises(CkptdError, match="CKPTD_AGENT_MIN_BYTES='lots'"):
        ckptd.Checkpointer(str(tmp_path / "root"), agent=True)  # before any agent is joined
    monkeypatch.setenv("CKPTD_AGENT_MIN_BYTES", "2MiB")
    with ckptd.Checkpointer(str(tmp_path / "root"), agent=True) as c:
        assert c.save({"w": torch.zeros(300_000)}, step=1).executor == "process"


def test_without_an_agent_every_save_says_process(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTD_AGENT_MIN_BYTES")
    with ckptd.Checkpointer(str(tmp_path / "root"), agent=False) as c:
        big = c.save({"w": torch.zeros(300_000)}, step=1)
    assert big.executor == "process"
