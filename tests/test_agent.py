"""The node agent (issue 13): real agent processes, real trainers killed with SIGKILL.

Every test gets its own agent directory and node id; the fixture stops the agent it started and
checks that no agent process is left."""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import logging
import multiprocessing as mp
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from agent_procs import Agents, alive, fork_ranks, reap, wait_until

import ckptd
from ckptd import config
from ckptd.agent import wire
from ckptd.agent.client import AgentClient

N = 1 << 18  # 1 MiB of float32 per rank


def _state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"model": {"w": ckptd.Shard(torch.randn(N, generator=g), (2 * N,), (rank * N,)),
                      "b": torch.full((16,), float(step))}}


def _expected(step: int) -> torch.Tensor:
    return torch.cat([_state(step, r)["model"]["w"].local for r in range(2)])


def _load(root: str, step: int | None = None) -> tuple[int, dict]:
    dst = {"model": {"w": torch.zeros(2 * N), "b": torch.zeros(16)}}
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as c:
        got = c.load(dst, step=step).step
    return got, dst


def _latest(root: str) -> int | None:
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as c:
        return c.latest_step()


# ----------------------------------------------------------------------------- kill the trainers
def _trainer(root: str, rank: int, run: str, steps: list[int], agent: bool | None,
             conn) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    c = ckptd.Checkpointer(root, rank=rank, world_size=2, run_id=run, agent=agent, keep_last=0)
    assert c.executor == "agent", "no agent"
    for i, step in enumerate(steps):
        h = c.save_async(_state(step, rank), step=step)
        if i < len(steps) - 1:
            h.result()
    conn.send("returned")
    conn.recv()  # killed here


def _kill_after_save(root: str, run: str, steps: list[int], agent: bool | None,
                     delay_s: float) -> None:
    """Two trainers of ``run`` save ``steps`` (each but the last committed); both are SIGKILLed
    ``delay_s`` after their last ``save_async`` returned."""
    ctx = mp.get_context("fork")
    procs, conns = [], []
    for rank in range(2):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_trainer, args=(root, rank, run, steps, agent, child))
        p.start()
        procs.append(p)
        conns.append(parent)
    for c in conns:  # both save_async calls returned
        assert c.poll(120), "a trainer did not reach its last save"
        assert c.recv() == "returned"
    time.sleep(delay_s)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join()
        assert p.exitcode == -signal.SIGKILL


def _kill_loop(root: str, agents: Agents, points: int, seed: int) -> None:
    rng = random.Random(seed)
    step = 0
    pids: set[int] = set()
    for i in range(points):
        steps = list(range(step + 1, step + 1 + rng.randint(1, 3)))
        # the kill point: 0-20 ms after save_async returned
        _kill_after_save(root, f"job{i}", steps, True, rng.uniform(0, 0.02))
        pids.add(agents.pid())
        # the agent commits the staged step without its trainers
        wait_until(lambda s=steps[-1]: _latest(root) == s, 60, f"step {steps[-1]} to commit")
        got, dst = _load(root)
        assert got == steps[-1]
        assert torch.equal(dst["model"]["w"], _expected(got)), f"step {got} is torn"
        assert torch.equal(dst["model"]["b"], torch.full((16,), float(got)))
        step = steps[-1]
    assert len(pids) == 1, "one agent serves every incarnation of the job"
    # the restart (one rank now) reads the last step from the agent's memory: committed after
    # its trainers died, it is kept all the same (rank 1's share is kept once its job ends,
    # which can be just after rank 0's agent job committed the step)
    wait_until(lambda: all(_holds_step(root, agents.node, r, step) for r in range(2)), 60,
               f"the agent to hold both ranks of step {step}")
    dst = {"model": {"w": torch.zeros(2 * N), "b": torch.zeros(16)}}
    with ckptd.Checkpointer(root, rank=0, world_size=1, run_id="restart", agent=True) as c:
        r = c.load(dst)
    assert r.step == step and torch.equal(dst["model"]["w"], _expected(step))
    assert r.nbytes_read > 0 and r.nbytes_from_memory == r.nbytes_read, r


def test_sigkill_of_every_trainer_after_save_async_still_commits(tmp_path, agents):
    _kill_loop(str(tmp_path / "root"), agents, points=3, seed=7)


@pytest.mark.slow
def test_sigkill_of_every_trainer_at_20_random_points(tmp_path, agents):
    _kill_loop(str(tmp_path / "root"), agents, points=20, seed=13)


# ----------------------------------------------------------------------------- lose the agent
def _big(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4 << 20, generator=g), "step": step}  # 16 MiB


def _check(root: str, step: int) -> None:
    dst = {"w": torch.zeros(4 << 20), "step": -1}
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as c:
        assert c.load(dst, step=step).step == step
    assert torch.equal(dst["w"], _big(step)["w"])


def test_sigkill_of_the_agent_mid_save_falls_back_and_loses_nothing(tmp_path, agents, caplog):
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, keep_last=0) as c:
        c.save(_big(1))
        pid = agents.pid()
        h = c.save_async(_big(2))  # the agent holds it now
        os.kill(pid, signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            assert h.result().step == 2  # committed by the agent or, if it died first, by us
            c.save(_big(3))  # in process from now on
            c.save(_big(4))
        lost = [r for r in caplog.records if "saving in process from now on" in r.message]
        assert len(lost) == 1, "the loss is said once"
        assert c.executor == "process"  # the agent was lost
    for step in (1, 2, 3, 4):
        _check(root, step)


def test_an_agent_that_stops_answering_is_noticed_and_replaced_by_the_trainer(
        tmp_path, agents, monkeypatch):
    monkeypatch.setenv("CKPTD_AGENT_TIMEOUT_S", "1")
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, keep_last=0) as c:
        c.save(_big(1))
        pid = agents.pid()
        os.kill(pid, signal.SIGSTOP)  # hung: the socket stays open, nothing answers
        try:
            t0 = time.monotonic()
            h = c.save_async(_big(2))
            assert h.result().step == 2
            assert time.monotonic() - t0 < 30
            wait_until(lambda: not alive(pid), 10, "the hung agent to be killed")
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
    _check(root, 1)
    _check(root, 2)


# ----------------------------------------------------------------------------- who may connect
def _as_nobody(path: str, conn) -> None:
    import json
    import socket
    import struct

    os.setgid(65534)
    os.setuid(65534)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
        conn.send(json.loads(s.recv(n, socket.MSG_WAITALL))["op"])
    except OSError as e:
        conn.send(f"error: {e}")


def _connect_as_nobody(path: str) -> str:
    parent, child = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=_as_nobody, args=(path, child))
    p.start()
    assert parent.poll(60)
    out = parent.recv()
    p.join()
    return out


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_a_client_of_another_user_is_refused(tmp_path, agents):
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True) as c:
        c.save({"w": torch.ones(4)}, step=1)
        # the directory keeps others out; open it up to reach the credentials check behind it
        os.chmod(agents.dir, 0o755)
        os.chmod(agents.paths["sock"], 0o666)
        try:
            assert _connect_as_nobody(agents.paths["sock"]) == "refused"
        finally:
            os.chmod(agents.dir, 0o700)
        assert "refused a client of uid 65534" in agents.log()
        c.save({"w": torch.ones(4)}, step=2)  # the agent still serves its own user


def test_a_shared_agent_directory_is_refused(agents):
    os.chmod(agents.dir, 0o777)
    with pytest.raises(wire.Refused, match="private"):
        AgentClient.connect({"url": "", "options": None}, threads=1)
    os.chmod(agents.dir, 0o700)


def test_a_malformed_job_is_refused_by_the_agent_not_followed(tmp_path, agents):
    client = AgentClient.connect({"url": str(tmp_path / "r"), "options": None}, threads=1)
    try:
        arena = client.allocate(4096)
        job = {"version": 1, "share": {"step": 1, "attempt": "x-1", "rank": 0, "world_size": 1,
                                       "declared": {"w": ["float32", [4096]]}, "values": {},
                                       "locals": {}, "training": {}},
               "nbytes": 4096, "files": [{"index": 0, "start": 0, "end": 16384,
                                          "slots": [["w", [0], [4096], 0, 16384]]}],
               "codec": "raw", "level": 0, "frame_bytes": 1 << 20,
               "commit": {"run_id": "x", "generation": 1, "overwrite": False, "keep_last": 0}}
        with pytest.raises(ckptd.CkptdError, match="does not fit"):
            client.submit(arena, job).reply.result()
        assert client.alive  # a bad request fails that request, not the agent
    finally:
        client.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="on by default on Linux")
def test_a_writer_uses_the_node_agent_by_default(tmp_path, agents, monkeypatch):
    """No ``agent=``, no ``$CKPTD_AGENT``, a job torchrun started: the save outlives its
    trainers, which only the agent can do; ``CKPTD_AGENT=0`` saves in process; any other value
    is refused, naming itself."""
    monkeypatch.delenv("CKPTD_AGENT")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    root = str(tmp_path / "r")
    _kill_after_save(root, "job", [1, 2], None, 0.0)
    wait_until(lambda: _latest(root) == 2, 60, "step 2 to commit")
    got, dst = _load(root)
    assert got == 2 and torch.equal(dst["model"]["w"], _expected(2))
    assert alive(agents.pid())
    monkeypatch.setenv("CKPTD_AGENT", "0")
    with ckptd.Checkpointer(root, rank=0, world_size=1) as c:
        assert c.executor == "process"
    monkeypatch.setenv("CKPTD_AGENT", "maybe")
    with pytest.raises(ckptd.CkptdError, match="CKPTD_AGENT='maybe'"):
        ckptd.Checkpointer(root, rank=0, world_size=1)


def test_a_second_agent_defers_to_the_first_and_an_idle_agent_exits(agents):
    cmd = [sys.executable, "-m", "ckptd.agent", "--node", agents.node, "--dir", agents.dir]
    first = subprocess.Popen([*cmd, "--idle-exit", "120"], stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: os.path.exists(agents.paths["sock"]), 60, "the agent's socket")
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert second.returncode == 0
        assert "another agent serves node" in second.stderr
        AgentClient.connect({"url": "", "options": None}, threads=1, start=False).stop_agent()
        assert first.wait(timeout=30) == 0
        assert not os.path.exists(agents.paths["sock"])
        idle = subprocess.run([*cmd, "--idle-exit", "0.5"], capture_output=True, text=True,
                              timeout=60)
        assert idle.returncode == 0 and "idle for" in idle.stderr
    finally:
        if first.poll() is None:
            first.kill()


def test_the_agent_s_writers_yield_to_its_session_threads(tmp_path, agents):
    with ckptd.Checkpointer(str(tmp_path / "r"), rank=0, world_size=1, agent=True) as c:
        c.save(_big(1))
        pid = agents.pid()
        nice = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                nice[int(tid)] = int(f.read().rpartition(")")[2].split()[16])
    assert nice[pid] == 0  # the main thread (accepts clients) and the session threads
    assert 10 in nice.values()  # the job and I/O threads: $CKPTD_AGENT_NICE, default 10
    assert sorted(set(nice.values())) == [0, 10]


# ----------------------------------------------------------------------------- the memory tier
def _save_on_node(root: str, rank: int, node: str, conn, stay: bool = False) -> None:
    """Step 1; ``stay``: then keep the Checkpointer (and its agent session) open until told."""
    torch.set_num_threads(1)
    os.environ["CKPTD_NODE_ID"] = node
    with ckptd.Checkpointer(root, rank=rank, world_size=2, run_id="first", agent=True) as c:
        c.save(_state(1, rank), step=1)
        if stay:
            conn.send("saved")
            conn.recv()
    if not stay:
        conn.send("saved")


def _load_step(root: str, rank: int, world: int,
                 step: int = 1) -> tuple[bool, int, int, int]:
    """Rank ``rank`` of ``world`` loads its slice of ``step`` (the latest) through its node's
    agent: bit-exact?, bytes read, from this node's memory, from other nodes' memory."""
    n = 2 * N
    a, b = rank * n // world, (rank + 1) * n // world  # uneven: 3 does not divide 2N evenly
    dst = {"model": {"w": ckptd.Shard(torch.zeros(b - a), (n,), (a,)), "b": torch.zeros(16)}}
    with ckptd.Checkpointer(root, rank=rank, world_size=world, run_id="second",
                            agent=True) as c:
        r = c.load(dst)
    ok = r.step == step and torch.equal(dst["model"]["w"].local, _expected(step)[a:b]) and \
        torch.equal(dst["model"]["b"], torch.full((16,), float(step)))
    return ok, r.nbytes_read, r.nbytes_from_memory, r.nbytes_from_peer


def _load_on(root: str, rank: int, world: int, node: str, conn, step: int = 1) -> None:
    torch.set_num_threads(1)
    os.environ["CKPTD_NODE_ID"] = node
    conn.send(_load_step(root, rank, world, step))


def _load_step_2_on(root: str, rank: int, world: int, node: str, conn) -> None:
    _load_on(root, rank, world, node, conn, 2)


def _ranks(target, args_of, world: int) -> list:
    out = []
    for p, parent in fork_ranks(target, args_of, world):
        assert parent.poll(120), "a rank did not finish"
        out.append(parent.recv())
        p.join()
        assert p.exitcode == 0
    return out


def _data_bytes(root: str, step: int) -> dict[str, int]:
    d = os.path.join(root, f"step-{step:09d}", "data")
    return {os.path.join(dp, f): os.path.getsize(os.path.join(dp, f))
            for dp, _, fs in os.walk(d) for f in fs if f.endswith(".bin")}


def test_a_restart_at_another_world_size_loads_from_the_agents_memory(tmp_path, agents):
    root = str(tmp_path / "root")
    node = agents.node
    _ranks(_save_on_node, lambda r: (root, r, node), 2)
    files = _data_bytes(root, 1)
    assert files
    for path in files:  # storage no longer has the data: only memory can serve it
        os.remove(path)
    got = _ranks(_load_on, lambda r: (root, r, 3, node), 3)
    for ok, nbytes, from_memory, from_peer in got:
        assert ok, "not bit-exact"
        assert nbytes > 0 and from_memory == nbytes and from_peer == 0  # nothing from storage


def test_a_lost_node_s_part_comes_from_storage_the_rest_from_memory(tmp_path, agents):
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    _ranks(_save_on_node, lambda r: (root, r, (a, b)[r]), 2)
    pid_b = agents.pid(b)
    os.kill(pid_b, signal.SIGKILL)  # node b is lost with its memory
    wait_until(lambda: not alive(pid_b), 10, "node b's agent to die")
    rank1 = {p: n for p, n in _data_bytes(root, 1).items() if "/r00001" in p}
    assert rank1
    got = _ranks(_load_on, lambda r: (root, r, 3, a), 3)
    assert all(ok for ok, *_ in got), "not bit-exact"
    assert all(p == 0 for *_, p in got)  # no peer copies without a job secret
    from_storage = [n - m for _, n, m, _ in got]
    # new rank 0 holds [0, 2N/3): old rank 0's, in memory (the 64-byte "b" may be rank 1's)
    assert got[0][2] > 0 and from_storage[0] <= 64
    # what storage served is rank 1's file: no rank read more than that from it
    assert all(0 <= s <= sum(rank1.values()) for s in from_storage)
    assert from_storage[2] > 0  # new rank 2 lies inside old rank 1's half


def test_the_agent_keeps_the_newest_step_in_the_arena_it_was_staged_in(tmp_path, agents):
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, keep_last=0) as c:
        for step in range(1, 6):
            c.save(_big(step))
        # two arenas take turns: one holds the newest step, the next save stages into the other
        assert c.pool.allocations == 2
        dst = {"w": torch.zeros(4 << 20), "step": -1}
        r = c.load(dst)
        assert r.step == 5 and torch.equal(dst["w"], _big(5)["w"])
        assert r.nbytes_read > 0 and r.nbytes_from_memory == r.nbytes_read
        r = c.load(dst, step=4)  # older: memory holds only the newest
        assert torch.equal(dst["w"], _big(4)["w"])
        assert r.nbytes_from_memory == 0 and r.nbytes_from_storage == r.nbytes_read


def test_the_agent_removes_an_old_step_once_the_next_save_is_staged(tmp_path, agents):
    root = tmp_path / "root"

    def steps() -> list[int]:
        return sorted(int(p.name[5:]) for p in root.glob("step-*"))

    with ckptd.Checkpointer(str(root), rank=0, world_size=1, agent=True, keep_last=1) as c:
        c.save(_big(1))
        c.save(_big(2))
        assert steps() == [1, 2]  # owed by the agent, not done: a next save may be staging
        c.save(_big(3))
        assert steps() == [2, 3]  # done before step 3's files were written
    # the trainer closed: its session ends and the agent settles what it still owed
    wait_until(lambda: steps() == [3], 30, "retention after the trainer closed")
    dst = {"w": torch.zeros(4 << 20), "step": -1}
    with ckptd.Checkpointer(str(root), rank=0, world_size=1, read_only=True) as c:
        assert c.load(dst).step == 3 and torch.equal(dst["w"], _big(3)["w"])


def _save_then_stall(root: str, rank: int, node: str, conn,
                     later: tuple[int, ...] = (2,)) -> ckptd.Checkpointer:
    """Step 1 on both ranks; the ``later`` steps on rank 1 only, all in flight at once (rank 0's
    node is lost before it hands step 2 over), so they never commit; rank 1 is killed while it
    waits for those commits."""
    torch.set_num_threads(1)
    os.environ["CKPTD_NODE_ID"] = node
    c = ckptd.Checkpointer(root, rank=rank, world_size=2, run_id="first", agent=True,
                           max_inflight=len(later))
    c.save(_state(1, rank), step=1)
    if rank == 1:
        for step in later:
            c.save_async(_state(step, rank), step=step)
    conn.send("saved")
    conn.recv()  # killed here (_stage_step_2: rank 0 goes on)
    return c


def _client_of(root: str, node: str) -> AgentClient:
    """A client of the agent running for ``node`` (of whatever environment: a test may have
    changed a setting since it started it)."""
    directory = os.environ["CKPTD_AGENT_DIR"]
    found = [p for p in wire.node_agents(node, directory) if wire.lock_pid(p["lock"])]
    assert len(found) == 1, f"{len(found)} agents run for node {node}"
    return AgentClient.connect({"url": root, "options": None}, threads=1, start=False,
                               node=node, paths=found[0])


def test_a_client_s_reader_has_ended_when_close_returns(tmp_path, agents):
    """``AgentClient.close`` closes the socket only once its reader thread has ended: closed
    under a reader about to call ``recv``, the descriptor's number can be the next
    connection's by then, and that reader takes the new connection's bytes (seen in CI: a
    test's next client read the body of its first answer as a length, 2,065,854,320 bytes,
    '{"op')."""
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root, rank=0, world_size=1, run_id="c", agent=True) as ckpt:
        assert ckpt.executor == "agent"
        for _ in range(20):
            c = _client_of(root, agents.node)
            c.held()
            c.close()
            assert not c._reader.is_alive(), "the reader outlived close()"


def _holds_step(root: str, node: str, rank: int, step: int) -> bool:
    c = _client_of(root, node)
    try:
        return any(f"step-{step:09d}/" in p and f"/r{rank:05d}" in p for p in c.held().files)
    finally:
        c.close()


def test_a_step_that_never_commits_does_not_push_the_committed_one_out_of_memory(
        tmp_path, agents):
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    procs = fork_ranks(_save_then_stall, lambda r: (root, r, (a, b)[r]), 2)
    for _, parent in procs:
        assert parent.poll(120) and parent.recv() == "saved"
    # node b's agent wrote step 2 (files and partial) and keeps it beside step 1
    wait_until(lambda: _holds_step(root, b, 1, 2), 60, "node b's agent to hold step 2")
    for p, _ in procs:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    assert _latest(root) == 1
    assert _holds_step(root, b, 1, 1), "the committed step was dropped for an uncommitted one"
    rank1 = {p: n for p, n in _data_bytes(root, 1).items() if "/r00001" in p}
    for path in rank1:  # only node b's memory can serve rank 1's part of step 1 now
        os.remove(path)
    [(ok, nbytes, from_memory, from_peer)] = _ranks(_load_on, lambda r: (root, r, 1, b), 1)
    assert ok, "not bit-exact"
    assert from_memory >= 4 * N and from_peer == 0  # rank 1's half of "w" at least


# ----------------------------------------------------------------------------- peer copies
def _holds(root: str, node: str, rank: int) -> bool:
    c = _client_of(root, node)
    try:
        return any(f"/r{rank:05d}" in p for p in c.held().files)
    finally:
        c.close()


def test_a_lost_node_is_read_from_its_peer_s_memory(tmp_path, agents, monkeypatch):
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    _ranks(_save_on_node, lambda r: (root, r, (a, b)[r]), 2)
    # each agent sends its node's part to the other (a ring of two), after the commit
    wait_until(lambda: _holds(root, a, 1) and _holds(root, b, 0), 60, "the peer copies")
    pid_b = agents.pid(b)
    os.kill(pid_b, signal.SIGKILL)  # node b is lost with its memory
    wait_until(lambda: not alive(pid_b), 10, "node b's agent to die")
    for path in _data_bytes(root, 1):  # and storage cannot serve the data either
        os.remove(path)
    got = _ranks(_load_on, lambda r: (root, r, 3, a), 3)
    for ok, nbytes, from_memory, from_peer in got:
        assert ok, "not bit-exact"
        assert nbytes > 0 and from_memory + from_peer == nbytes  # nothing from storage
    # new rank 0 lies inside old rank 0's half (node a's own), new rank 2 inside old rank 1's
    # (node b's, which node a holds a peer copy of); the 64-byte "b" may be either's
    assert got[0][3] <= 64 and got[2][2] <= 64 and got[2][3] > 0
    # the restarted job (one rank, a new run) commits step 2: node a's agent lets go of step 1,
    # its own rank 0's and node b's copy of rank 1's (no restart loads it any more)
    monkeypatch.setenv("CKPTD_NODE_ID", a)
    with ckptd.Checkpointer(root, rank=0, world_size=1, run_id="third", agent=True) as c:
        c.save({"model": {"w": torch.zeros(2 * N), "b": torch.zeros(16)}}, step=2)
    assert _holds_step(root, a, 0, 2)
    assert not _holds_step(root, a, 0, 1) and not _holds_step(root, a, 1, 1)


def _stage_step_2(root: str, rank: int, node: str, conn) -> None:
    """Step 1 on both ranks; step 2 staged on rank 1 (killed after), saved by rank 0 when
    told (it commits with rank 1's share, which rank 1's agent wrote)."""
    c = _save_then_stall(root, rank, node, conn)  # rank 1 is killed in there
    c.save(_state(2, rank), step=2)
    c.close()
    conn.send("committed")


def test_a_copy_sent_while_its_step_is_written_outlives_a_node_lost_before_the_commit(
        tmp_path, agents, monkeypatch):
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    monkeypatch.setenv("CKPTD_PEER_COPY", "staged")
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    procs = fork_ranks(_stage_step_2, lambda r: (root, r, (a, b)[r]), 2)
    try:
        for _, parent in procs:
            assert parent.poll(120) and parent.recv() == "saved"
        # node b's agent wrote rank 1's share of step 2, which cannot commit yet (rank 0 has
        # not saved it), and node a holds its copy already: sent when it was staged, not after
        # the commit (the default, under which this wait times out)
        wait_until(lambda: _holds_step(root, b, 1, 2) and _holds_step(root, a, 1, 2), 60,
                   "node a to hold rank 1's step 2 before it commits")
        assert _holds_step(root, a, 1, 1), "the committed copy went before its successor"
        pid_b = agents.pid(b)
        os.kill(pid_b, signal.SIGKILL)  # node b is lost with its memory, and its trainer
        os.kill(procs[1][0].pid, signal.SIGKILL)
        wait_until(lambda: not alive(pid_b), 10, "node b's agent to die")
        procs[0][1].send("go")  # rank 0's share: step 2 commits
        assert procs[0][1].poll(120) and procs[0][1].recv() == "committed"
    finally:
        reap(procs)
    assert _latest(root) == 2
    for path in _data_bytes(root, 2):  # storage cannot serve rank 1's part of step 2
        if "/r00001" in path:
            os.remove(path)
    [(ok, nbytes, from_memory, from_peer)] = _ranks(_load_step_2_on, lambda r: (root, r, 1, a),
                                                    1)
    assert ok, "not bit-exact"
    assert nbytes == from_memory + from_peer and from_peer >= 4 * N  # rank 1's half: the copy


def test_a_peer_keeps_a_committed_copy_behind_two_copies_in_flight(tmp_path, agents,
                                                                   monkeypatch):
    """The commit notice a peer gets: node a holds rank 1's step 1 as committed, so the copies of
    steps 2 and 3 that arrive while they are written do not push it out (an unconfirmed copy is
    kept only while it is one of the newest two: without the notice step 1 would go)."""
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    monkeypatch.setenv("CKPTD_PEER_COPY", "staged")
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    procs = fork_ranks(functools.partial(_save_then_stall, later=(2, 3)),
                       lambda r: (root, r, (a, b)[r]), 2)
    try:
        for _, parent in procs:
            assert parent.poll(120) and parent.recv() == "saved"
        wait_until(lambda: _holds_step(root, a, 1, 2) and _holds_step(root, a, 1, 3), 60,
                   "node a to hold rank 1's steps 2 and 3 before they commit")
        assert _holds_step(root, a, 1, 1), "the committed copy went before its successors"
        assert _latest(root) == 1
    finally:
        # node b's jobs wait for rank 0's shares of steps 2 and 3, which never come: it is
        # killed, not stopped (a stop would wait them out for its grace window)
        with contextlib.suppress(FileNotFoundError, ValueError):  # (not started: no pid)
            os.kill(agents.pid(b), signal.SIGKILL)
        reap(procs)


def _load_in_group(rank: int, world: int, root: str, env: dict[str, str], nodes: list[str]):
    # one offer per node: from the node's first local rank
    local = nodes[:rank].count(nodes[rank])
    os.environ.update(env, CKPTD_NODE_ID=nodes[rank], LOCAL_RANK=str(local))
    return _load_step(root, rank, world)


def test_a_restart_on_other_nodes_reads_what_another_agent_holds_from_it(tmp_path, agents,
                                                                        monkeypatch):
    from multirank import run

    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    monkeypatch.setenv("CKPTD_PEER_COPIES", "0")  # each agent holds its own node's part only
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    _ranks(_save_on_node, lambda r: (root, r, (a, b)[r]), 2)
    for path in _data_bytes(root, 1):  # storage cannot serve the data
        os.remove(path)
    env = {k: os.environ[k] for k in ("CKPTD_AGENT_DIR", "CKPTD_JOB_SECRET", "CKPTD_PEER_COPIES")}
    # the new world's ranks on the other node than the data they need: new rank 0 ([0, 2N/3),
    # old rank 0's, node a's) runs on node b, new ranks 1 and 2 on node a
    got = run(_load_in_group, 3, root, env, [b, a, a], timeout=120)
    for ok, nbytes, from_memory, from_peer in got:
        assert ok, "not bit-exact"
        assert nbytes == from_memory + from_peer  # nothing from storage
    # (the 64-byte "b" was written by one of the old ranks: it may come from either node)
    assert got[0][3] >= 4 * (2 * N // 3) and got[0][2] <= 64  # node a's, read over TCP
    assert got[1][2] > 0 and got[1][3] > 0  # half its own node's, half node b's
    assert got[2][3] > 0 and got[2][2] <= 64  # inside old rank 1's half: node b's


def test_a_peer_without_the_job_secret_is_refused(tmp_path, agents, monkeypatch, caplog):
    import json

    from ckptd.agent.replication import Outgoing, Replicator

    monkeypatch.setenv("CKPTD_JOB_SECRET", "the-right-one")
    root = str(tmp_path / "root")
    _ranks(_save_on_node, lambda r: (root, r, agents.node), 2)
    with open(os.path.join(root, "_agents", f"{agents.node}.json")) as f:
        me = json.load(f)
    intruder = Replicator("intruder", b"a-wrong-guess", ("127.0.0.1", 1), 1, None)
    item = Outgoing({"url": root, "options": None}, None, 0, 99,  # type: ignore[arg-type]
                    {"step-000000099/data/x/r00000-0.bin": memoryview(b"x" * 64)}, lambda: None)
    with pytest.raises(ConnectionError, match="refused this agent"):
        intruder._send(me, item)
    wait_until(lambda: "refused a peer" in agents.log(), 10, "the agent's log line")
    c = AgentClient.connect({"url": root, "options": None}, threads=1, start=False)
    try:
        assert all("step-000000099" not in p for p in c.held().files)
    finally:
        c.close()


def _send_as_peer(me: dict, root: str, step: int, data: bytes, digest_of: bytes) -> dict:
    """A copy of ``data`` to the agent at ``me`` over the peer wire, by hand, followed by the
    digest of ``digest_of``: the agent's last answer."""
    import xxhash

    from ckptd.agent.peer_wire import answer_challenge

    with socket.create_connection((me["host"], me["port"]), timeout=30) as s:
        answer_challenge(s, b"s3cret-of-this-job", "refused")
        wire.send(s, {"spec": {"url": root, "options": None}, "origin": "mallory", "rank": 0,
                      "step": step, "run": "r", "committed": True,
                      "files": {f"step-{step:09d}/data/x/r00000-0.bin": len(data)}})
        assert wire.recv(s, 4096)["ok"]
        s.sendall(data)
        wire.send(s, {"xxh3": xxhash.xxh3_64_hexdigest(digest_of)})
        return wire.recv(s, 4096)


def test_a_peer_copy_that_arrives_damaged_is_not_kept(tmp_path, agents, monkeypatch):
    """What a peer sends is followed by its digest: bytes that differ from what was sent (damaged
    on the wire) are dropped, not kept — nor, for a hand-off, written with checksums of the
    damage."""
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    root = str(tmp_path / "root")
    on_a = AgentClient.connect({"url": root, "options": None}, threads=1)  # registers it
    try:
        with open(os.path.join(root, "_agents", f"{agents.node}.json")) as f:
            me = json.load(f)
        sent = bytes(range(256)) * 64
        damaged = sent[:100] + b"\xff" + sent[101:]
        reply = _send_as_peer(me, root, 98, damaged, digest_of=sent)
        assert not reply["ok"] and "damaged" in reply["error"]
        assert _send_as_peer(me, root, 99, sent, digest_of=sent)["ok"]  # the control
        held = on_a.held().files
        assert not any("step-000000098" in p for p in held)
        assert any("step-000000099" in p for p in held)
        # the damaged copy's memory went back: one peer segment left, step 99's
        assert len(glob.glob(f"/dev/shm/ckptd-{os.getuid()}-{agents.node}-*+*.peer-*")) == 1
        assert "mallory's rank 0 step 98 arrived damaged" in agents.log()
    finally:
        on_a.close()


def test_the_agent_says_when_a_node_s_state_cannot_be_written_inside_the_grace_window(
        tmp_path, agents, monkeypatch, caplog):
    monkeypatch.setenv("CKPTD_GRACE_S", "1e-9")  # any state takes longer than that
    with ckptd.Checkpointer(str(tmp_path / "r"), rank=0, world_size=1, agent=True) as c:
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            c.save(_big(1))
            c.save(_big(2))
    said = [r.message for r in caplog.records if "of SIGTERM grace" in r.message]
    assert len(said) == 1, "said once"
    assert "GB per node at" in said[0] and "CKPTD_JOB_SECRET" in said[0]


@pytest.mark.parametrize("limit, env, said", [
    (["--memory-budget", "1MiB"], {}, "budget"),  # 16 MiB: over the agent's budget
    ([], {"CKPTD_AGENT_MEM_RESERVE": "1000TiB"}, "reserve"),  # no node leaves that much free
], ids=["budget", "node-reserve"])
def test_over_the_agent_s_memory_budget_the_trainer_saves_in_process(tmp_path, agents, caplog,
                                                                     monkeypatch, limit, env,
                                                                     said):
    cmd = [sys.executable, "-m", "ckptd.agent", "--node", agents.node, "--dir", agents.dir,
           *limit]
    for k, v in env.items():  # the trainer's environment too: an agent serves its own
        monkeypatch.setenv(k, v)
    agent = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: os.path.exists(agents.paths["sock"]), 60, "the agent's socket")
        root = str(tmp_path / "root")
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True) as c:
                c.save(_big(1))
                c.save(_big(2))
        assert any("cannot hold" in r.message and said in r.message
                   for r in caplog.records)
        _check(root, 1)
        _check(root, 2)
    finally:
        agent.terminate()
        agent.wait(timeout=30)


def test_an_agent_that_cannot_start_is_given_up_at_once(tmp_path, agents, monkeypatch, caplog):
    """A setting the agent refuses (here its memory reserve) ends it before it listens: the
    trainer says so at once, naming the agent's log, which names the setting, and saves in
    process (before, it waited the 60 s start timeout for a socket that could not come)."""
    monkeypatch.setenv("CKPTD_AGENT_MEM_RESERVE", "lots")
    root = str(tmp_path / "root")
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True) as c:
            assert c.executor == "process"
            c.save(_big(1))
    said = [r.message for r in caplog.records if "exited at once" in r.message]
    assert len(said) == 1 and agents.paths["log"] in said[0], said
    assert "CKPTD_AGENT_MEM_RESERVE='lots'" in agents.log()
    _check(root, 1)


def test_a_peer_copy_over_the_receiver_s_budget_is_skipped(tmp_path, agents, monkeypatch):
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    a, b = agents.node, agents.node + "-b"
    small = subprocess.Popen([sys.executable, "-m", "ckptd.agent", "--node", b, "--dir",
                              agents.dir, "--memory-budget", "1.5MiB"],
                             stderr=open(wire.paths(b, agents.dir)["log"], "ab"))
    try:
        wait_until(lambda: os.path.exists(wire.paths(b, agents.dir)["sock"]), 60, "node b's agent")
        root = str(tmp_path / "root")
        # the trainers stay: a gone trainer's kept step is dropped to make room, and the
        # copy would then fit (whether it does would depend on which comes first)
        ctx = mp.get_context("fork")
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [ctx.Process(target=_save_on_node, args=(root, r, (a, b)[r], pipes[r][1], True))
                 for r in range(2)]  # 1 MiB a rank
        for p in procs:
            p.start()
        try:
            for parent, _ in pipes:
                assert parent.poll(120) and parent.recv() == "saved"
            wait_until(lambda: _holds(root, a, 1), 60, "node b's part on node a")
            def log_b() -> str:
                return agents.log(b)
            wait_until(lambda: "no room for node" in log_b(), 60, "node b to refuse node a's part")
            assert not _holds(root, b, 0)
        finally:
            for parent, _ in pipes:
                parent.send("go")
            for p in procs:
                p.join(60)
                assert p.exitcode == 0
    finally:
        small.terminate()
        small.wait(timeout=30)


def test_a_step_a_load_is_reading_is_not_given_back_to_its_trainer(tmp_path, agents):
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, keep_last=0) as c:
        c.save(_big(1))
        reader = AgentClient.connect({"url": root, "options": None}, threads=1, start=False)
        held = reader.held()  # a load in another process holds step 1
        files, lease = held.files, held.lease
        before = {p: bytes(m) for p, m in files.items()}
        for step in (2, 3, 4):  # step 1's arena is dropped from memory but stays pinned
            c.save(_big(step))
        assert {p: bytes(m) for p, m in files.items()} == before, "overwritten under a load"
        assert c.pool.allocations == 3  # the trainer staged into a third arena meanwhile
        reader.unpin(lease)
        reader.close()
        for step in (5, 6, 7):  # given back: no more allocations
            c.save(_big(step))
        assert c.pool.allocations == 3


def test_a_remote_read_that_fails_is_read_from_storage_once_warned(tmp_path, caplog):
    from ckptd.storage import open_storage
    from ckptd.storage.tiered import MemoryTier

    storage = open_storage(str(tmp_path))
    payload = bytes(range(256)) * 64
    storage.put_atomic("step-000000001/data/x/r00001-0.bin", payload)

    class DeadAgent:  # an agent that died after it said what it held
        size = len(payload)
        calls = 0

        def read_into(self, offset: int, buf: memoryview) -> None:
            DeadAgent.calls += 1
            raise ConnectionRefusedError("connection refused")

    path = "step-000000001/data/x/r00001-0.bin"
    tier = MemoryTier(storage, {}, (), {path: DeadAgent()})
    session = tier.open_read([path])
    try:
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            for offset in (0, 4096, 8192):
                buf = bytearray(4096)
                session.read_into(path, offset, memoryview(buf))
                assert bytes(buf) == payload[offset:offset + 4096]
    finally:
        session.close()
    assert DeadAgent.calls == 1  # not asked again after it failed
    assert tier.served == 0
    warnings = [r.getMessage() for r in caplog.records
                if "reading it from storage" in r.getMessage()]
    assert len(warnings) == 1 and "r00001-0.bin" in warnings[0]


# ----------------------------------------------------------------------------- SIGTERM hand-off
def _handoff_records(root: str, step: int) -> list[dict]:
    from ckptd.agent import handoff
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as c:
        attempt = c.read_manifest(step).attempt
        return handoff.read_records(c.storage, step, attempt)


def test_a_save_a_stopping_agent_cannot_write_in_the_grace_window_goes_to_a_peer(
        tmp_path, agents, monkeypatch):
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    # node b's agent serves this root (its trainers said hello): it is a's successor in the ring
    on_b = AgentClient.connect({"url": root, "options": None}, threads=1, node=b)
    try:
        # node a's storage writes 1 kB/s as far as its agent knows: 16 MiB take hours, > 30 s
        monkeypatch.setenv("CKPTD_AGENT_WRITE_BPS", "1000")
        with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, run_id="r1") as c:
            first = c.save(_big(1))  # not stopping: node a writes it, however slowly
            assert first.handed_to is None
            pid_a = agents.pid()
            os.kill(pid_a, signal.SIGTERM)
            wait_until(lambda: "stopping;" in agents.log(), 30, "node a's agent to see the SIGTERM")
            # the trainer's last save comes after the SIGTERM: a still takes it, cannot write
            # it in the grace left, and hands it to b, which writes and commits it
            h = c.save_async(_big(2))
            assert h.wait_safe(60)
            assert h.handed_to == b
            second = h.result(60)
            assert second.handed_to == b
        wait_until(lambda: not alive(pid_a), 30, "node a's agent to exit once its trainer closed")
        _check(root, 2)
        assert _latest(root) == 2
        (record,) = _handoff_records(root, 2)
        assert (record["from"], record["to"], record["rank"], record["step"]) == (a, b, 0, 2)
        assert _handoff_records(root, 1) == []
        log_b = agents.log(b)
        assert f"wrote node {a}'s rank 0 step 2" in log_b
        assert "handed to node" in agents.log()
    finally:
        on_b.close()


def _eight(step: int) -> dict:
    """16 MiB in 8 tensors: 8 files (with 1 MiB files allowed), to stop between."""
    w = _big(step)["w"]
    return {**{f"w{i}": w[i << 19: (i + 1) << 19] for i in range(8)}, "step": step}


def _check_eight(root: str) -> None:
    want = _eight(1)
    dst = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as c:
        assert c.load(dst).step == 1
    for k, v in want.items():
        assert torch.equal(dst[k], v) if isinstance(v, torch.Tensor) else dst[k] == v, k


@contextlib.contextmanager
def _staged_pair(tmp_path, agents: Agents, monkeypatch, grace_s: int, rate: int):
    """Two nodes of a job with ``CKPTD_PEER_COPY=staged`` and ``grace_s`` of grace: node b's agent
    serving the root (started first, writing at the disk's speed), then node a's settings —
    its agent, started by the test's Checkpointer, writes at most ``rate`` bytes/s. Yields the
    root and node b."""
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    monkeypatch.setenv("CKPTD_PEER_COPY", "staged")
    monkeypatch.setenv("CKPTD_GRACE_S", str(grace_s))
    root, b = str(tmp_path / "root"), agents.node + "-b"
    on_b = AgentClient.connect({"url": root, "options": None}, threads=1, node=b)
    try:
        monkeypatch.setenv("CKPTD_AGENT_WRITE_RATE", str(rate))
        yield root, b
    finally:
        on_b.close()


def _stop_mid_write(root: str, agents: Agents, stop_b_first: bool) -> ckptd.SaveResult:
    """Node a's agent writes ``_eight(1)`` (16 MiB in 8 files) at its ``CKPTD_AGENT_WRITE_RATE``
    while node b holds the save's staged copy; a is SIGTERMed with more than its grace window
    left to write (b first, if ``stop_b_first``). The save's result."""
    b = agents.node + "-b"
    with config.override(min_file_bytes=1 << 20):
        with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, run_id="r1") as c:
            h = c.save_async(_eight(1))
            wait_until(lambda: _holds_step(root, b, 0, 1), 30, "node b to hold the copy")
            if stop_b_first:
                os.kill(agents.pid(b), signal.SIGTERM)
                wait_until(lambda: "stopping;" in agents.log(b),
                           30, "node b's agent to see its SIGTERM")
            os.kill(agents.pid(), signal.SIGTERM)
            return h.result(120)


def test_a_save_being_written_at_sigterm_is_written_by_the_peer_that_holds_its_copy(
        tmp_path, agents, monkeypatch):
    """``CKPTD_PEER_COPY=staged``: node b holds the save's copy while node a writes it. Node a is
    SIGTERMed with more left to write than its grace window allows: it stops between two files,
    and node b writes the whole save from its copy — only the job travels — and commits it."""
    a = agents.node
    with _staged_pair(tmp_path, agents, monkeypatch, 5, 1_000_000) as (root, b):
        pid_a = agents.pid
        out = _stop_mid_write(root, agents, stop_b_first=False)
        assert out.handed_to == b
        wait_until(lambda: not alive(pid_a()), 30, "node a's agent to exit")
        assert _latest(root) == 1
        _check_eight(root)
        (record,) = _handoff_records(root, 1)
        assert (record["from"], record["to"], record["rank"], record["step"]) == (a, b, 0, 1)
        log_a = agents.log()
        assert "rank 0 step 1: stopped with" in log_a
        assert f"rank 0 step 1 is written by node {b} from the copy it holds" in log_a
        log_b = agents.log(b)
        assert f"wrote node {a}'s rank 0 step 1" in log_b
        assert _holds_step(root, b, 0, 1)  # and it keeps the copy, committed, for a restart


def test_a_file_being_written_at_sigterm_is_stopped_between_two_of_its_blocks(
        tmp_path, agents, monkeypatch):
    """One 160 MiB tensor, so one file: the stop comes between two of its 64 MiB blocks, not
    after it (a rank's file can be a quarter of its share: minutes at a node's share of the
    storage's bandwidth)."""
    # the first block goes at once, the second's turn is 6.7 s later: the file takes 17 s
    with _staged_pair(tmp_path, agents, monkeypatch, 3, 10_000_000) as (root, b):
        state = {"w": torch.randn(40 << 20, generator=torch.Generator().manual_seed(7)),
                 "step": 1}
        with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, run_id="r1") as c:
            h = c.save_async(state)
            wait_until(lambda: _holds_step(root, b, 0, 1), 60, "node b to hold the copy")
            os.kill(agents.pid(), signal.SIGTERM)
            assert h.result(120).handed_to == b
    assert len([p for p in _data_bytes(root, 1) if p.endswith(".bin")]) == 1  # one file
    stopped = re.search(r"rank 0 step 1: stopped with (\d+) of (\d+) bytes", agents.log())
    assert stopped and 0 < int(stopped.group(1)) < int(stopped.group(2))  # inside the file
    dst = {"w": torch.zeros(40 << 20), "step": 0}
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as c:
        assert c.load(dst).step == 1
    assert torch.equal(dst["w"], state["w"])


def test_a_save_stopped_at_sigterm_that_no_peer_takes_over_is_written_here(
        tmp_path, agents, monkeypatch):
    """The peer that holds the copy is stopping too: it refuses, and node a writes the save
    itself, past its grace window — late, perhaps, but not lost."""
    with _staged_pair(tmp_path, agents, monkeypatch, 3, 4_000_000) as (root, b):  # 4 s > 3 s
        assert _stop_mid_write(root, agents, stop_b_first=True).handed_to is None
    _check_eight(root)
    assert _handoff_records(root, 1) == []
    log_a = agents.log()
    assert "rank 0 step 1: stopped with" in log_a
    # (refused while node b drains its session, lost if it has exited already)
    assert ("does not write rank 0 step 1 from its copy: " in log_a and "stopping too" in log_a
            or f"node {b}, which holds rank 0 step 1, is lost" in log_a)
    # the files written before the stop are not written again (the first one starts at once)
    left = re.search(r"rank 0 step 1: no peer writes it from its copy; writing it here "
                     r"\((\d+) of its 8 files left\)", log_a)
    assert left and int(left.group(1)) < 8


class _MutePeer:
    """A peer of the job (it knows the secret), by hand over real TCP: it takes copies and
    answers notices, and when asked to write a copy it never answers — a peer that took the
    request and hung, or whose answer was lost."""

    def __init__(self, secret: bytes) -> None:
        self.secret, self.asked = secret, threading.Event()
        self._done = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        import hashlib
        import hmac

        with conn, contextlib.suppress(OSError, ValueError):
            nonce = os.urandom(32)
            wire.send(conn, {"nonce": nonce.hex()})
            mac = wire.recv(conn)["mac"]
            ok = hmac.compare_digest(mac, hmac.new(self.secret, nonce, hashlib.sha256).hexdigest())
            wire.send(conn, {"ok": ok})
            header = wire.recv(conn, 64 << 20)
            if header.get("op") == "write":
                self.asked.set()
                self._done.wait()  # silent until the test ends
            elif "files" in header:  # a copy: taken
                wire.send(conn, {"ok": True})
                left = sum(header["files"].values())
                while left:
                    left -= len(conn.recv(min(left, 1 << 20)))
                wire.recv(conn)  # its digest
                wire.send(conn, {"ok": True})
            else:
                wire.send(conn, {"ok": True})

    def close(self) -> None:
        self._done.set()
        self.sock.close()


def test_a_peer_that_took_the_write_and_never_answered_is_not_doubled_here(
        tmp_path, agents, monkeypatch):
    """Node a stops its write and asks the peer holding the copy to write it; the peer never
    answers. It may be writing it, so node a does not write it too (two writers of one share
    could tear a step one of them commits): the save is the peer's or lost — the previous step
    stays ``latest`` — never torn."""
    from ckptd.errors import CkptdError
    from ckptd.storage import open_storage

    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    monkeypatch.setenv("CKPTD_PEER_COPY", "staged")
    monkeypatch.setenv("CKPTD_GRACE_S", "3")
    monkeypatch.setenv("CKPTD_AGENT_WRITE_RATE", "1000000")
    root = str(tmp_path / "root")
    mute = _MutePeer(b"s3cret-of-this-job")
    try:
        open_storage(root).put_atomic("_agents/mute.json", json.dumps(
            {"node": "mute", "host": "127.0.0.1", "port": mute.port}).encode())
        with config.override(min_file_bytes=1 << 20, commit_timeout_s=3):
            c = ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, run_id="r1")
            try:
                h = c.save_async(_eight(1))
                wait_until(lambda: "rank 0 step 1 copied to node mute" in agents.log(), 30,
                           "the copy to reach the mute peer")
                os.kill(agents.pid(), signal.SIGTERM)
                assert h.wait_safe(60) and h.handed_to == "mute"
                with pytest.raises(CkptdError, match="no commit"):  # the peer commits nothing
                    h.result(60)
                assert mute.asked.is_set()
            finally:
                c.close()
    finally:
        mute.close()
    log_a = agents.log()
    assert "rank 0 step 1: node mute got a 'write' request and did not answer" in log_a
    assert "it may be writing it, so no other node does" in log_a
    assert "writing it here" not in log_a
    assert _latest(root) is None


def test_a_stopping_agent_with_no_peer_to_take_it_writes_the_save_itself(tmp_path, agents,
                                                                          monkeypatch):
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")  # but no other node
    monkeypatch.setenv("CKPTD_AGENT_WRITE_BPS", "1000")
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, run_id="r1") as c:
        c.save(_big(1))
        os.kill(agents.pid(), signal.SIGTERM)
        wait_until(lambda: "stopping;" in agents.log(), 30, "the agent to see the SIGTERM")
        assert c.save(_big(2)).handed_to is None  # late, perhaps, but not lost
    _check(root, 2)
    assert _handoff_records(root, 2) == []
    assert "rank 0 step 2: no peer took it; writing it here" in agents.log()


def test_a_stopping_agent_removes_no_old_step(tmp_path, agents):
    """Its grace window is for saves: the retention its commits owe is left to the next run.
    (Step 2's commit, before the SIGTERM, starts the removal of step 1 at once; step 3's, by
    the stopping agent, removes nothing.)"""
    root = tmp_path / "root"
    with ckptd.Checkpointer(str(root), rank=0, world_size=1, agent=True, keep_last=1) as c:
        c.save(_big(1))
        c.save(_big(2))  # starts the removal of step 1
        wait_until(lambda: not (root / "step-000000001").exists(), 60, "step 1's removal")
        os.kill(agents.pid(), signal.SIGTERM)
        wait_until(lambda: "stopping;" in agents.log(), 30, "the agent to see the SIGTERM")
        assert c.save(_big(3)).step == 3  # the preemption save, written by the stopping agent
    pid = agents.pid()
    wait_until(lambda: not alive(pid), 60, "the agent to exit")
    assert sorted(int(p.name[5:]) for p in root.glob("step-*")) == [2, 3]
    _check(str(root), 3)


def test_a_stopping_agent_counts_every_save_it_is_writing_against_the_grace_left(
        tmp_path, monkeypatch):
    """The ranks of a node send their last saves together: each may fit the grace window
    alone, but the node's disk writes them all. The agent takes what fits with the saves it is
    writing already (the rest are handed off), and frees their bytes once written."""
    from ckptd.agent.server import Agent

    monkeypatch.setenv("CKPTD_AGENT_WRITE_BPS", str(1 << 20))  # 1 MiB/s
    monkeypatch.setenv("CKPTD_GRACE_S", "30")
    agent = Agent("n", str(tmp_path))
    assert agent.book_write(20 << 20)  # not stopping: taken (and counted)
    agent.stop()
    assert agent.book_write(8 << 20)  # with the 20 MiB being written: 28 s of the 30 s
    assert not agent.book_write(4 << 20)  # 32 s: it would fit alone, not with the others
    # no peer took it: written here, and counted
    assert not agent.book_write(4 << 20, force=True)
    agent.unbook_write(20 << 20)
    assert agent.book_write(16 << 20)  # 8 + 4 + 16 MiB: 28 s
    assert not agent.book_write(4 << 20)


def test_a_hand_off_gives_up_on_a_peer_that_never_answers_when_the_grace_window_ends(
        tmp_path, agents, monkeypatch):
    """The only peer accepts the connection and never says a word (a hung agent): the stopping
    agent gives up on it when its grace window ends, not after a fixed minute, and writes the
    save itself."""
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    monkeypatch.setenv("CKPTD_AGENT_WRITE_BPS", "1000")  # 16 MiB cannot be written in time
    monkeypatch.setenv("CKPTD_GRACE_S", "5")
    root = str(tmp_path / "root")
    from ckptd.storage import open_storage

    with socket.create_server(("127.0.0.1", 0)) as hung:  # the kernel accepts; nobody reads
        open_storage(root).put_atomic("_agents/hung.json", json.dumps(
            {"node": "hung", "host": "127.0.0.1", "port": hung.getsockname()[1]}).encode())
        with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True, run_id="r1") as c:
            c.save(_big(1))
            os.kill(agents.pid(), signal.SIGTERM)
            wait_until(lambda: "stopping;" in agents.log(), 30, "the agent to see the SIGTERM")
            t0 = time.monotonic()
            assert c.save(_big(2)).handed_to is None
            # a bound on the failure only: the old fixed socket timeout was 60 s
            assert time.monotonic() - t0 < 45
    _check(root, 2)
    log_text = agents.log()
    assert "hand-off of rank 0 step 2 to node hung failed" in log_text
    assert "rank 0 step 2: no peer took it; writing it here" in log_text


def test_a_preemption_save_the_node_cannot_write_in_time_is_safe_via_a_peer_and_recorded(
        tmp_path, agents, monkeypatch, clean_sigterm):
    from ckptd import elastic
    from ckptd.elastic import preemption

    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    root = str(tmp_path / "root")
    a, b = agents.node, agents.node + "-b"
    on_b = AgentClient.connect({"url": root, "options": None}, threads=1, node=b)
    reference = elastic.TrainingSpec(1, 1, 2, 2, 16)
    model = elastic.ModelSpec(hidden_size=32, num_hidden_layers=2, num_parameters=20_000)
    policy = elastic.ElasticPolicy(tolerance=0.0, mem_limit_gib=1.0, max_micro_batch_size=4)
    try:
        monkeypatch.setenv("CKPTD_AGENT_WRITE_BPS", "1000")  # node a: 16 MiB need hours
        ckpt = ckptd.Checkpointer(root, rank=0, world_size=1, agent=True)
        try:
            assert ckpt.hands_off
            run = elastic.resume(ckpt, reference=reference, model=model, policy=policy)
            run.step_done()
            run.save(_big(1))
            run.step_done()
            os.kill(agents.pid(), signal.SIGTERM)  # the node is being preempted: its agent
            wait_until(lambda: "stopping;" in agents.log(), 30, "node a's agent to see the SIGTERM")
            os.kill(os.getpid(), signal.SIGTERM)  # ... and its trainer
            assert ckptd.preempted()
            out = run.save_on_preemption(_big(2))
            assert (out.safe_via, out.saved, out.exit_code) == (f"peer {b}", False, 0)
            assert "handed to node" in out.reason
        finally:
            ckpt.close()  # its save thread waits for node b's commit
        assert _latest(root) == 2
        _check(root, 2)
        preemption.uninstall()
        with ckptd.Checkpointer(root, rank=0, world_size=1, agent=False) as again:
            nxt = elastic.resume(again, reference=reference, model=model, policy=policy)
            assert nxt.resumed_step == 2
            assert nxt.entry.safe_via == f"peer {b}"
            assert nxt.meta.history[0].safe_via is None  # the first start resumed nothing
        (record,) = _handoff_records(root, 2)
        assert (record["from"], record["to"]) == (a, b)
    finally:
        on_b.close()
