"""Randomized kills around the node agent (slow): the agent and the trainers SIGKILLed at random
moments and at each file of a save, the agent stopped (SIGSTOP) for 2-12 s, both killed.
Whatever happens, every step a trainer was told is committed loads bit-exactly, the newest
committed step loads bit-exactly, and nobody hangs (every wait here is bounded).

Two trainers (ranks 0 and 1) of one root per trial, each trial a new run of the job; one root
for all trials, so every trial also restarts after the previous one's wreckage."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch
from agent_procs import alive, reap, wait_until
from test_agent import N, _state

import ckptd
from ckptd import config
from ckptd.agent import wire
from ckptd.manifest import layout

EIGHT_FILES = 8  # a save of the file-kill trials: 8 files of 1 MiB a rank


def _big_state(step: int, rank: int) -> dict:
    """2 MiB a rank in EIGHT_FILES tensors (one file each with 1 MiB files allowed)."""
    g = torch.Generator().manual_seed(7000 * step + rank)
    w = torch.randn(EIGHT_FILES * (1 << 16), generator=g)
    return {"p": {f"w{i}": ckptd.Shard(w[i << 16: (i + 1) << 16], (2 << 16,), (rank << 16,))
                  for i in range(EIGHT_FILES)}, "step": step}


def _trainer(root: str, rank: int, run: str, steps: list[int], big: bool, conn) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    with config.override(min_file_bytes=1 << 20):
        c = ckptd.Checkpointer(root, rank=rank, world_size=2, run_id=run, agent=True,
                               keep_last=0)
        for step in steps:
            h = c.save_async(_big_state(step, rank) if big else _state(step, rank), step=step)
            conn.send(("staged", step))
            h.result(120)
            conn.send(("committed", step))
        c.close()
    conn.send(("done", None))


def _expected(step: int, big: bool) -> dict:
    if big:
        parts = [_big_state(step, r)["p"] for r in range(2)]
        return {k: torch.cat([parts[0][k].local, parts[1][k].local]) for k in parts[0]}
    return {"w": torch.cat([_state(step, r)["model"]["w"].local for r in range(2)]),
            "b": torch.full((16,), float(step))}


def _check_step(root: str, step: int, big: bool) -> None:
    want = _expected(step, big)
    if big:
        dst: dict = {"p": {k: torch.zeros_like(v) for k, v in want.items()}, "step": -1}
    else:
        dst = {"model": {"w": torch.zeros(2 * N), "b": torch.zeros(16)}}
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as c:
        assert c.load(dst, step=step, strict=False).step == step
    got = dst["p"] if big else dst["model"]
    for k, v in want.items():
        assert torch.equal(got[k], v), f"step {step}: {k} is not what was saved"


def _committed(root: str) -> list[int]:
    return sorted(s for s in map(layout.parse_step_dir, os.listdir(root)) if s is not None
                  and os.path.exists(os.path.join(root, layout.manifest_path(s))))


def _data_files(root: str, step: int) -> int:
    d = os.path.join(root, layout.step_dir(step), "data")
    return sum(len(fs) for _, _, fs in os.walk(d)) if os.path.isdir(d) else 0


class Trial:
    """One run of the job under a fault; what its trainers said."""

    def __init__(self, root: str, run: str, steps: list[int], big: bool) -> None:
        ctx = mp.get_context("fork")
        self.steps, self.big = steps, big
        self.procs, self.pipes = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_trainer, args=(root, rank, run, steps, big, child))
            p.start()
            self.procs.append(p)
            self.pipes.append(parent)
        self.said: list[list[tuple[str, int | None]]] = [[], []]

    def until(self, what: str, step: int | None, timeout_s: float = 120) -> None:
        """Until both trainers said ``(what, step)`` (or died)."""
        deadline = time.monotonic() + timeout_s
        for r, pipe in enumerate(self.pipes):
            while (what, step) not in self.said[r]:
                left = deadline - time.monotonic()
                assert left > 0, f"rank {r} did not say {what} {step}: {self.said[r]}"
                if not pipe.poll(min(left, 0.5)):
                    if not self.procs[r].is_alive():
                        return
                    continue
                try:
                    self.said[r].append(pipe.recv())
                except EOFError:
                    return

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)

    def finish(self) -> set[int]:
        """Wait for the trainers (bounded), then reap them; the steps both said committed."""
        self.until("done", None, 240)
        reap(list(zip(self.procs, self.pipes, strict=True)))
        return {s for what, s in self.said[0] if what == "committed" and s is not None} & {
            s for what, s in self.said[1] if what == "committed" and s is not None}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it died meanwhile (a trainer killed it): the fault came all the same


def _agent_pid(agents) -> int | None:
    return wire.lock_pid(agents.paths["lock"])


KINDS = ["trainers", "agent", "agent-at-file", "sigstop", "both"]


@pytest.mark.slow
def test_random_kills_of_the_agent_and_the_trainers_lose_nothing(tmp_path, agents, monkeypatch):
    rng = random.Random(20261127)
    root = str(tmp_path / "root")
    plan = [k for k in KINDS for _ in range(7)][:34]  # 34 trials
    rng.shuffle(plan)
    step = 0
    gone = 0  # trials whose agent was gone at the kill point already
    told: set[int] = set()
    for i, kind in enumerate(plan):
        big = kind == "agent-at-file"
        # the file-kill trials write at 8 MiB/s so that a kill lands between two files (an
        # agent of that setting: the rate is part of its environment)
        if big:
            monkeypatch.setenv("CKPTD_AGENT_WRITE_RATE", str(8 << 20))
        else:
            monkeypatch.delenv("CKPTD_AGENT_WRITE_RATE", raising=False)
        steps = list(range(step + 1, step + 1 + rng.randint(1, 3)))
        step = steps[-1]
        last = steps[-1]
        trial = Trial(root, f"job{i}", steps, big)
        what = f"trial {i} ({kind}, steps {steps})"
        try:
            if kind == "trainers":
                trial.until("staged", last)
                time.sleep(rng.uniform(0, 0.02))  # the kill point, not a synchronisation
                trial.kill()
            elif kind in ("agent", "both", "sigstop"):
                at = rng.choice(steps)
                trial.until("staged", at)
                pid = _agent_pid(agents)
                if pid is None:  # already gone (a trainer that heard nothing for
                    gone += 1  # CKPTD_AGENT_TIMEOUT_S on a loaded machine kills it): a fault
                    pid = -1  # all the same, and nothing to kill
                time.sleep(rng.uniform(0, 0.05))  # the kill point
                if pid < 0:
                    pass
                elif kind == "sigstop":
                    _signal(pid, signal.SIGSTOP)
                    time.sleep(rng.uniform(2, 12))  # how long it is stopped: the fault itself
                    _signal(pid, signal.SIGCONT)  # (silent past the timeout: a trainer killed it)
                else:
                    _signal(pid, signal.SIGKILL)
                if kind == "both":
                    time.sleep(rng.uniform(0, 0.05))
                    trial.kill()
            else:  # agent-at-file: SIGKILL the agent once k files of a save are written
                at = rng.choice(steps)
                k = rng.randint(1, 2 * EIGHT_FILES)
                trial.until("staged", at)
                pid = _agent_pid(agents)
                if pid is None:
                    gone += 1
                    pid = -1
                manifest = os.path.join(root, layout.manifest_path(at))
                wait_until(lambda at=at, k=k, m=manifest: _data_files(root, at) >= k
                           or os.path.exists(m), 120, f"{what}: {k} files of step {at}")
                if pid > 0:
                    _signal(pid, signal.SIGKILL)
            told |= trial.finish()
        finally:
            trial.kill()
            reap(list(zip(trial.procs, trial.pipes, strict=True)))
        if kind in ("trainers",):  # the agent commits what they staged
            wait_until(lambda last=last: last in _committed(root), 60,
                       f"{what}: step {last} to commit without its trainers")
        for s in steps:
            if s in told or s == max(_committed(root), default=-1):
                _check_step(root, s, big)
        lost = told - set(_committed(root))
        assert not lost, f"{what}: steps told committed are not: {sorted(lost)}"
    assert len(told) >= 10, f"too few steps committed to mean anything: {sorted(told)}"
    assert gone <= 4, f"{gone} of {len(plan)} trials found no agent to kill"
    for pid in (_agent_pid(agents),):
        assert pid is None or alive(pid)
