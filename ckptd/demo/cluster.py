"""The simulated cluster of ``ckptd demo`` and the torchrun tests: a c10d rendezvous store
process, and per simulated node a ``torchrun --nnodes=MIN:MAX --nproc-per-node=1`` agent running
the training script, with its own ckptd node agent (``docs/agent.md``); SIGTERM (a preemption)
or SIGKILL (a lost node) to everything on a node; the workers' events read back.

Two settings make this work on torch 2.13 (see docs/elastic.md for the evidence):

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in every agent's environment. With the default
  (shared TCP store), ``DynamicRendezvousHandler.next_rendezvous`` computes the bootstrap
  ``MASTER_ADDR``/``MASTER_PORT`` once and caches it; in a later round, a node that joins has no
  cache and waits for ``MASTER_ADDR`` under the new round's key prefix, which the cached rank 0
  never writes, while rank 0 waits for the newcomer's ``role_info`` -- both time out.
- keep-alive ``1 s x 3`` (not ``x 2``): heartbeats are sent at most every interval and may be
  almost two intervals old when read, so ``x 2`` lets a joining node declare live nodes dead
  and start a rendezvous of its own.

This module only starts and watches processes; training, saving and re-planning happen in the
workers (``ckptd.elastic.resume``). It never imports ``integrations/``: it runs the script.
"""


from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ckptd.agent import wire
from ckptd.agent.shm import stale_segments, unlink
from ckptd.elastic.events import EventLog
from ckptd.errors import CkptdError

_STORE_MAIN = """
import socket, sys
from datetime import timedelta
import torch.distributed as dist
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", 0))
sock.listen(64)
port = sock.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      multi_tenant=True, master_listen_fd=sock.detach(),
                      timeout=timedelta(seconds=600))
print(port, flush=True)
sys.stdin.read()  # until the parent closes the pipe (or dies)
"""

AGENT_ENV = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "PYTHONUNBUFFERED": "1",
    "LOGLEVEL": "INFO",
}
# A waiting agent polls the rendezvous state once a second (torch's c10d backend sleeps 1 s
# between polls), and a round that has MIN nodes closes ``last_call`` seconds after its latest
# joiner. With a last call of 1 s, a survivor whose poll lands a moment late misses the round
# and costs everyone a second restart (seen in CI: 3 -> 2, then 2 -> 2 without the slow node,
# then 2 -> 3). 3 s leaves two polls of slack; a round that reaches MAX nodes closes at once.
LAST_CALL_S = 3


def rdzv_conf(last_call_s: int = LAST_CALL_S) -> str:
    """The ``--rdzv-conf`` of every agent (see ``docs/elastic.md``, "Scale-up in place")."""
    return (f"is_host=0,join_timeout=120,last_call_timeout={last_call_s},close_timeout=10,"
            "keep_alive_interval=1,keep_alive_max_attempt=3")


class DemoError(CkptdError, RuntimeError):
    """The demo's cluster did not reach a state in time, or a process failed."""


def default_script() -> Path:
    """``integrations/torchrun/train.py`` of the source checkout this package runs from."""
    return Path(__file__).resolve().parents[2] / "integrations" / "torchrun" / "train.py"


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process (Linux /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), fields[19])
    return table


def _descendants(roots: set[int]) -> set[tuple[int, str]]:
    table, found, frontier = _proc_table(), set(), set(roots)
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier}
        found |= {(pid, table[pid][1]) for pid in frontier}
    return found


@dataclasses.dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float


class Cluster:
    """torchrun agents on 127.0.0.1 around one rendezvous store; owns every process it starts
    and kills what is left of them (agents, their workers) on :meth:`close`.

    ``train_args`` go to the training script; the events file is ``workdir/events.jsonl``.
    ``max_nodes`` is torchrun's MAX (a round that reaches it closes at once), ``last_call_s``
    the rendezvous' last call (see :data:`LAST_CALL_S`). With ``agents``, every node's
    trainers save through a node agent of its own (node id ``<rdzv id>-<name>``), which the
    cluster signals with its node and stops on :meth:`close`.
    """

    def __init__(self, workdir: Path, train_args: list[str], *, script: Path | None = None,
                 max_nodes: int = 4, nproc_per_node: int = 1, grace_s: float = 30.0,
                 python: str = sys.executable, monitor_interval: float = 0.5,
                 last_call_s: int = LAST_CALL_S, agents: bool = False) -> None:
        self.workdir = workdir
        self.events_path = workdir / "events.jsonl"
        self.script = script or default_script()
        if not self.script.exists():
            raise DemoError(f"{self.script}: training script not found (the demo runs from a "
                            "source checkout; pass script=/--script)")
        self.train_args, self.max_nodes, self.grace_s = train_args, max_nodes, grace_s
        self.nproc_per_node = nproc_per_node
        self.python, self.monitor_interval = python, monitor_interval
        self.rdzv_conf = rdzv_conf(last_call_s)
        self.rdzv_id = f"ckptd-{uuid.uuid4().hex[:8]}"
        self.nodes: list[Node] = []
        self._seen: set[tuple[int, str]] = set()  # every descendant ever seen (pid, start)
        self._timers: list[threading.Timer] = []
        self._events: list[dict[str, Any]] = []
        self._offset = 0
        self.store: subprocess.Popen[str] | None = None
        self.port = 0
        # a socket path has at most 107 bytes: the agents' directory is short, not in workdir
        self.agent_dir = tempfile.mkdtemp(prefix="ckag") if agents else None
        self._secret = secrets.token_hex(16)

    # --------------------------------------------------------------- processes
    def start_store(self) -> int:
        # the store lives until its stdin closes: if the demo itself is killed, the store goes,
        # the agents' rendezvous calls fail, and they stop their workers and exit
        self.store = subprocess.Popen([self.python, "-c", _STORE_MAIN], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        assert self.store.stdout is not None
        line = self.store.stdout.readline()  # the child prints its port once it listens
        if not line.strip().isdigit():
            raise DemoError(f"rendezvous store did not start (exit code {self.store.poll()})")
        self.port = int(line)
        return self.port

    def add_node(self, name: str | None = None) -> Node:
        if self.store is None:
            self.start_store()
        name = name or "abcdefghijklmnop"[len(self.nodes)]
        log = self.workdir / f"node-{name}.log"
        cmd = [self.python, "-m", "torch.distributed.run", f"--nnodes=1:{self.max_nodes}",
               f"--nproc-per-node={self.nproc_per_node}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.rdzv_id}",
               f"--rdzv-conf={self.rdzv_conf}", "--local-addr=127.0.0.1", "--max-restarts=100",
               f"--monitor-interval={self.monitor_interval}",
               # torchrun's per-attempt directories (its workers' error files): in the work
               # directory, not a torchelastic_* directory of its own left in $TMPDIR
               f"--log-dir={self.workdir / 'torchrun' / name}", str(self.script),
               *self.train_args, "--events", str(self.events_path)]
        env = {**os.environ, **AGENT_ENV,
               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(self.grace_s))}
        if self.agent_dir is not None:
            env.update(CKPTD_AGENT="1", CKPTD_NODE_ID=self.node_id(name),
                       CKPTD_AGENT_DIR=self.agent_dir, CKPTD_JOB_SECRET=self._secret,
                       CKPTD_GRACE_S=str(self.grace_s), CKPTD_PEER_COPY="staged",
                       # the demo's model is tiny (kBs a rank): below the default 1 MiB a
                       # rank's save would be written in process, and the agents it shows
                       # would hold nothing
                       CKPTD_AGENT_MIN_BYTES="0")
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        node = Node(name, proc, log, time.time())
        self.nodes.append(node)
        return node

    def node_id(self, name: str) -> str:
        return f"{self.rdzv_id}-{name}"

    def agent_pid(self, name: str) -> int | None:
        """The pid of node ``name``'s ckptd agent, if one holds its lock."""
        if self.agent_dir is None or not os.path.isdir(self.agent_dir):
            return None
        for found in wire.node_agents(self.node_id(name), self.agent_dir):
            pid = wire.lock_pid(found["lock"])
            if pid is not None:
                return pid
        return None

    def _doomed(self, node: Node) -> set[tuple[int, str]]:
        """Every process of ``node``: its torchrun agent, the workers, its ckptd agent."""
        doomed = _descendants({node.proc.pid}) | {(node.proc.pid, "")}
        pid = self.agent_pid(node.name)
        if pid is not None:
            doomed.add((pid, _proc_table().get(pid, (0, ""))[1]))
        self._seen |= doomed
        return doomed

    def preempt(self, node: Node) -> float:
        """What a batch system does to a node: SIGTERM now (the torchrun agent forwards it to
        its workers; the ckptd agent finishes its staged saves), SIGKILL to whatever of it is
        still alive ``grace_s`` later. Returns the wall time of the SIGTERM."""
        doomed = self._doomed(node)
        t = time.time()
        node.proc.send_signal(signal.SIGTERM)
        pid = self.agent_pid(node.name)
        if pid is not None:
            self._kill({(pid, "")}, signal.SIGTERM)
        timer = threading.Timer(self.grace_s, self._kill, args=(doomed,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return t

    def lose(self, node: Node) -> float:
        """A node lost outright (power, network, kernel panic): SIGKILL to every process of it
        at once, no warning; a ``node_lost`` event marks the time. Returns that time."""
        self._kill(self._doomed(node))
        t = time.time()
        EventLog(str(self.events_path), -1).emit("node_lost", quiet=True, node=node.name)
        return t

    def _kill(self, procs: set[tuple[int, str]], sig: int = signal.SIGKILL) -> None:
        table = _proc_table()
        for pid, start in procs:
            if pid in table and (not start or table[pid][1] == start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def close(self) -> None:
        """Stop everything this cluster started: agents (SIGTERM, then SIGKILL), every worker
        they ever had, the store."""
        for timer in self._timers:
            timer.cancel()
        live = self.alive()
        self._seen |= _descendants({n.proc.pid for n in live})
        for n in live:
            with contextlib.suppress(ProcessLookupError):
                n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for n in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self._kill(self._seen | {(n.proc.pid, "") for n in self.alive()})
        for n in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=5)
        if self.store is not None:
            assert self.store.stdin is not None
            with contextlib.suppress(OSError):
                self.store.stdin.close()
            self.store.kill()
            self.store.wait()
            self.store = None
        self._stop_agents()

    def _stop_agents(self) -> None:
        """SIGTERM to every node's ckptd agent (they finish what they write), SIGKILL to any
        still running 30 s later; then their segments and directory go."""
        if self.agent_dir is None:
            return
        table = _proc_table()
        agents = {(pid, table[pid][1]) for pid in map(self.agent_pid, {n.name for n in self.nodes})
                  if pid is not None and pid in table}
        self._kill(agents, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while agents and time.monotonic() < deadline:
            agents &= {(pid, start) for pid, (_, start) in _proc_table().items()}
            time.sleep(0.05)
        self._kill(agents)
        for n in self.nodes:
            for found in wire.node_agents(self.node_id(n.name), self.agent_dir):
                instance = os.path.basename(found["lock"])[len("agent-"):-len(".lock")]
                for path in stale_segments(instance)[0]:
                    unlink(path)
        shutil.rmtree(self.agent_dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- observing
    def events(self) -> list[dict[str, Any]]:
        """Every event the workers appended so far (read incrementally)."""
        try:
            with open(self.events_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self._events
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        self._events += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        return self._events

    def wait_for(self, what: str, predicate: Callable[[dict[str, Any]], bool],
                 timeout: float = 120.0, *, after: float = 0.0) -> dict[str, Any]:
        """The first event (with ``t >= after``) satisfying ``predicate``; raises DemoError
        naming ``what`` after ``timeout`` s or when every agent has exited."""
        deadline = time.monotonic() + timeout
        while True:
            self._seen |= _descendants({n.proc.pid for n in self.alive()})
            for ev in self.events():
                if ev["t"] >= after and predicate(ev):
                    return ev
            if not self.alive() or time.monotonic() > deadline:
                state = {n.name: n.proc.poll() for n in self.nodes}
                raise DemoError(f"timed out waiting for {what} (agents: {state}); logs in "
                                f"{self.workdir}:\n{self.tail()}")
            time.sleep(0.05)

    def wait_exit(self, timeout: float = 120.0) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return {n.name: n.proc.poll() for n in self.nodes}

    def tail(self, lines: int = 15) -> str:
        out = []
        for n in self.nodes:
            text = n.log.read_text(errors="replace").splitlines() if n.log.exists() else []
            out.append(f"--- node {n.name} ---\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


def step_reached(world: int, step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["ev"] == "step" and e["world"] == world and e["step"] >= step


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM to the demo raises SystemExit like Ctrl-C raises KeyboardInterrupt, so the
    cluster's cleanup runs in both cases (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
