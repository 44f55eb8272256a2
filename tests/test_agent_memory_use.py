"""What the node agent holds, says and leaves (issue 34): it leaves a container's small
``/dev/shm`` to the DataLoader, gives back the steps of roots no job uses, says once that it
started, shows what it holds, and stops when asked. Real agent processes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from agent_procs import alive, wait_until

import ckptd
from ckptd.agent import wire
from ckptd.cli import main as ckptd_command

MiB = 1 << 20


def _status(capsys) -> dict:
    capsys.readouterr()
    ckptd_command(["agent", "--status", "--json"])
    return json.loads(capsys.readouterr().out)


_SMALL_SHM_JOB = textwrap.dedent("""
    import os, sys, torch, ckptd
    from torch.utils.data import DataLoader, Dataset

    class Batches(Dataset):  # 8 MiB a batch, handed over through /dev/shm by the workers
        def __len__(self): return 12
        def __getitem__(self, i): return torch.full((2 * 1024 * 1024,), float(i))

    torch.set_num_threads(1)
    state = {"w": torch.randn(25 * 1024 * 1024 // 4)}  # 25 MiB
    with ckptd.Checkpointer(sys.argv[1], rank=0, world_size=1, agent=True) as c:
        for step in (1, 2, 3):
            c.save(state, step=step)
        held = c.executor == "agent"
        seen = sum(float(b[0, 0]) for b in DataLoader(Batches(), batch_size=1, num_workers=2))
    print("served by the agent:", held, flush=True)
    assert seen == sum(range(12)), seen
    print("dataloader ok", flush=True)
""")


def test_a_64_mib_dev_shm_is_left_to_the_dataloader(tmp_path, agents):
    """A container's default /dev/shm (64 MiB, a private mount here): three saves of a 25 MiB
    state, then a DataLoader with two workers and 8 MiB batches. The agent leaves the reserve
    to the training processes (here: all of it), so the DataLoader runs; the saves commit."""
    if shutil.which("unshare") is None:
        pytest.fail("needs unshare (util-linux) to give the job a 64 MiB /dev/shm")
    root = str(tmp_path / "root")
    script = tmp_path / "job.py"
    script.write_text(_SMALL_SHM_JOB)
    run = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
         f"exec {sys.executable} {script} {root}; "
         f"{sys.executable} -m ckptd agent --stop"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dataloader ok" in run.stdout
    assert "CKPTD_AGENT_SHM_RESERVE" in run.stderr  # the one warning says why not the agent
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as c:
        assert c.latest_step() == 3


def _save_and_leave(root: str, step: int = 1) -> None:
    with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True) as c:
        assert c.executor == "agent"
        c.save({"w": torch.full((MiB // 4,), float(step))}, step=step)


def test_the_steps_of_deleted_and_unused_roots_are_given_back(tmp_path, agents, capsys,
                                                             monkeypatch):
    """Three short jobs on three roots, then two roots deleted: their steps leave memory at
    once; the third root's, once no trainer used it for the release window (1 s here), while
    the agent idles on."""
    monkeypatch.setenv("CKPTD_AGENT_RELEASE_S", "1")
    roots = [str(tmp_path / f"root{i}") for i in range(3)]
    live = ckptd.Checkpointer(roots[2], rank=0, world_size=1, agent=True)
    try:
        live.save({"w": torch.ones(MiB // 4)}, step=1)
        for root in roots[:2]:
            _save_and_leave(root)
        held = {r["url"] for r in _status(capsys)["agents"][0]["roots"]}
        assert held == set(roots), held
        for root in roots[:2]:
            shutil.rmtree(root)
        wait_until(lambda: {r["url"] for r in _status(capsys)["agents"][0]["roots"]} == {roots[2]},
                   30, "the deleted roots' steps to be given back")
        [st] = _status(capsys)["agents"]
        assert st["roots"][0]["in_use"] and st["roots"][0]["bytes"] >= MiB
    finally:
        live.close()
    # its trainer gone, the live root's step goes after the release window; the agent stays
    wait_until(lambda: _status(capsys)["agents"][0]["roots"] == [], 30,
               "the last root's step to be given back")
    seen: list[dict] = []

    def counting_down() -> bool:
        """Idling towards its exit. Each status call has a session of its own, which the agent
        ends a moment after the call closed: the previous call's may still count (seen in CI
        under two workers), and exits_in_s is None while a session is open."""
        seen[:] = _status(capsys)["agents"]
        return seen[0]["exits_in_s"] is not None

    wait_until(counting_down, 30, "the agent to count down to its exit")
    [st] = seen
    assert st["memory_used"] == 0 and alive(st["pid"]) and st["roots"] == []


def test_starting_an_agent_is_said_once_and_status_and_stop_tell_what_it_holds(
        tmp_path, agents, caplog, capsys):
    root = str(tmp_path / "root")
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        _save_and_leave(root)
        _save_and_leave(root, 2)  # a second trainer: the agent runs already, nothing said
    said = [r.getMessage() for r in caplog.records if "started a node agent" in r.getMessage()]
    assert len(said) == 1, said
    pid = agents.pid()
    for what in (f"pid {pid}", "ckptd agent --stop", "CKPTD_AGENT=0", agents.paths["log"],
                 "GiB"):
        assert what in said[0], (what, said[0])
    # what it held from its start is frozen: the collector's full passes skip it
    assert _status(capsys)["agents"][0]["gc_frozen"] > 10_000
    capsys.readouterr()
    assert ckptd_command(["agent", "--status"]) == 0
    text = capsys.readouterr().out
    for what in (f"agent pid {pid}", f"ckptd {ckptd.__version__}", agents.paths["log"], root,
                 "MiB", "given back in"):
        assert what in text, (what, text)
    assert ckptd_command(["agent", "--stop"]) == 0
    assert "stopped" in capsys.readouterr().out
    assert not alive(pid)
    assert ckptd_command(["agent", "--status"]) == 1
    assert "no agent runs" in capsys.readouterr().out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_the_agent_is_on_by_default_for_a_launched_job_only(tmp_path, agents, monkeypatch):
    """No ``agent=`` and no ``$CKPTD_AGENT``: a process a launcher started (torchrun sets
    TORCHELASTIC_RUN_ID, SLURM SLURM_JOB_ID, env:// launchers WORLD_SIZE) hands its saves to
    the node's agent; a script run by hand saves in process and starts nothing."""
    monkeypatch.delenv("CKPTD_AGENT")
    for v in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    with ckptd.Checkpointer(str(tmp_path / "a"), rank=0, world_size=1) as c:
        assert c.executor == "process"
    assert wire.node_agents(agents.node, agents.dir) == []  # no agent was started
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    with ckptd.Checkpointer(str(tmp_path / "b"), rank=0, world_size=1) as c:
        assert c.executor == "agent"
        c.save({"w": torch.ones(4)}, step=1)
    assert alive(agents.pid())
    assert os.path.exists(os.path.join(tmp_path, "b", "step-000000001", "manifest.json"))
