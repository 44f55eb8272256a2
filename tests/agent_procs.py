"""Node agents in tests: processes to watch, and the ``agents`` fixture's body (declared in
conftest.py): every test gets its own agent directory and node id; the fixture stops every
agent started in it and checks that none is left."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import pytest

import ckptd
from ckptd.agent import client as client_module
from ckptd.agent import wire
from ckptd.writer import commit


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (our own child, not reaped yet) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # it exited between the two looks
        return False


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def count_commit_waits(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often a trainer here waited for a commit and told its agent it saw one."""
    calls = {"waited": 0, "told": 0}
    wait, tell = commit.wait_committed, client_module.AgentClient.saw_commit

    def waited(*a, **k):  # type: ignore[no-untyped-def]
        calls["waited"] += 1
        return wait(*a, **k)

    def told(*a, **k):  # type: ignore[no-untyped-def]
        calls["told"] += 1
        return tell(*a, **k)

    monkeypatch.setattr(commit, "wait_committed", waited)
    monkeypatch.setattr(client_module.AgentClient, "saw_commit", told)
    return calls


@contextlib.contextmanager
def two_agent_ranks(root: str) -> Iterator[tuple[ckptd.Checkpointer, ckptd.Checkpointer]]:
    """Ranks 0 and 1 of one run in this process, each with its own session of this node's
    agent (the ``agents`` fixture's)."""
    with ckptd.Checkpointer(root, rank=0, world_size=2, run_id="r2", agent=True) as c0, \
            ckptd.Checkpointer(root, rank=1, world_size=2, run_id="r2", agent=True) as c1:
        assert c0.executor == c1.executor == "agent"
        yield c0, c1


class Agents:
    """The test's agent directory and node. An agent's files are named by its node and its
    environment's digest (``wire.paths``): a test that changes a setting after an agent
    started talks to another agent, so these look a node's agents up whatever their
    environment."""

    def __init__(self, directory: str, node: str) -> None:
        self.dir, self.node = directory, node

    @property
    def paths(self) -> dict[str, str]:
        """The files of the agent this process's environment would use on the test's node."""
        return wire.paths(self.node, self.dir)

    def pid(self, node: str | None = None) -> int:
        """The pid of the running agent of ``node`` (default: the test's own node); if none
        runs, of the one that ran last (FileNotFoundError, ValueError: none ever started)."""
        found = wire.node_agents(node or self.node, self.dir)
        running = [pid for p in found if (pid := wire.lock_pid(p["lock"])) is not None]
        if len(running) == 1:
            return running[0]
        assert not running, f"{len(running)} agents run for node {node or self.node}"
        if not found:
            raise FileNotFoundError(f"no agent of node {node or self.node} in {self.dir}")
        newest = max(found, key=lambda p: os.path.getmtime(p["lock"]))
        with open(newest["lock"]) as f:
            return int(f.read())

    def running(self, node: str | None = None) -> dict[str, str]:
        """The files of the one running agent of ``node`` (default: the test's own), whatever
        its environment."""
        found = [p for p in wire.node_agents(node or self.node, self.dir)
                 if wire.lock_pid(p["lock"]) is not None]
        assert len(found) == 1, f"{len(found)} agents run for node {node or self.node}"
        return found[0]

    def log(self, node: str | None = None) -> str:
        """The logs of every agent of ``node`` (default: the test's own), one after another."""
        out = []
        for p in wire.node_agents(node or self.node, self.dir):
            if os.path.exists(p["log"]):
                with open(p["log"]) as f:
                    out.append(f.read())
        return "".join(out)


def serve_agents(monkeypatch: pytest.MonkeyPatch) -> Iterator[Agents]:
    """The ``agents`` fixture (conftest.py): its own agent directory and node id; at the end
    every agent started in it is stopped, and none may be left running."""
    d = tempfile.mkdtemp(prefix="ckag")  # short: a socket path has at most 107 bytes
    node = f"n{os.getpid()}-{random.randrange(1 << 30)}"
    monkeypatch.setenv("CKPTD_AGENT_DIR", d)
    monkeypatch.setenv("CKPTD_NODE_ID", node)
    # a test of the agent asks for it where it wants it (agent=True, CKPTD_AGENT=1): the rest
    # of its processes save in process whichever executor the suite runs
    monkeypatch.setenv("CKPTD_AGENT", "0")
    a = Agents(d, node)
    try:
        yield a
    finally:
        stop_agents_in(d, node)


def stop_agents_in(d: str, node: str) -> None:
    """Stop every agent started in directory ``d`` (every node's: tests may simulate several,
    named ``node...``), remove the directory and their segments, and check none is left."""
    started: list[int] = []
    for name in os.listdir(d) if os.path.isdir(d) else ():
        if name.endswith(".lock") and os.path.getsize(os.path.join(d, name)):
            with open(os.path.join(d, name)) as f:
                started.append(int(f.read()))
    for pid in started:
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
    try:
        for pid in started:
            wait_until(lambda pid=pid: not alive(pid), 30, f"agent {pid} to exit")
    finally:
        shutil.rmtree(d, ignore_errors=True)
        for path in glob.glob(f"/dev/shm/ckptd-{os.getuid()}-{node}*"):
            os.unlink(path)  # a killed agent's segments (the next agent would remove them)

    def running() -> list[int]:  # a second agent started in a race exits by itself
        out = subprocess.run(["pgrep", "-f", f"ckptd.agent --node {node}"],
                             capture_output=True, text=True).stdout.split()
        return [int(p) for p in out if alive(int(p))]

    for pid in running():  # one that lost a start race and took the lock after ours died
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not running(), 30, "every agent to exit")


def fork_ranks(target: Callable[..., None], args_of: Callable[[int], tuple],
               world: int) -> list[tuple[mp.Process, Connection]]:
    """``target(*args_of(rank), pipe)`` in a forked process per rank, started: each process
    with the parent's end of its pipe."""
    ctx = mp.get_context("fork")
    procs = []
    for rank in range(world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(*args_of(rank), child))
        p.start()
        procs.append((p, parent))
    return procs


def reap(procs: list[tuple[mp.Process, Connection]]) -> None:
    """SIGKILL whichever of ``procs`` still runs (a failed test leaves none waiting on its
    pipe) and join them all."""
    for p, _ in procs:
        if p.is_alive():
            p.kill()
        p.join()
