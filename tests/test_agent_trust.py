"""The node agent does what its trainer would have done, whoever started it and whatever is
around it (issue 34): a relative root is the trainer's, an agent of other code is not used, an
error keeps its class, a squatted name or a linked directory does not stop it, a flood of
connections does not take it down. Real agent processes throughout."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from agent_procs import alive, wait_until

import ckptd
from ckptd.agent import wire
from ckptd.agent.client import AgentClient
from ckptd.manifest import layout


def _start_agent(agents, *args: str, cwd: str | None = None,
                 env: dict[str, str] | None = None, python: str = sys.executable,
                 preexec=None) -> subprocess.Popen:
    """An agent of the test's node started by hand (as a launcher would), serving once its
    socket answers."""
    proc = subprocess.Popen([python, "-m", "ckptd.agent", "--node", agents.node, "--dir",
                             agents.dir, *args], cwd=cwd, env=env,
                            stderr=open(agents.paths["log"], "ab"), preexec_fn=preexec)
    wait_until(lambda: os.path.exists(agents.paths["sock"]) or proc.poll() is not None, 60,
               "the agent's socket")
    assert proc.poll() is None, agents.log()
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
    proc.wait(timeout=60)


def _served_by(c: ckptd.Checkpointer) -> int | None:
    """The pid of the agent a Checkpointer hands its saves to (that of its environment, on the
    test's node); None: it saves in process."""
    return wire.lock_pid(wire.paths(wire.node_id(), wire.agent_dir())["lock"]) \
        if c.executor == "agent" else None


# ----------------------------------------------------------------------------- a relative root
def test_a_relative_root_is_the_trainer_s_whoever_started_the_agent(tmp_path, agents,
                                                                    monkeypatch):
    """An agent started from directory a (a launcher's ``ckptd agent &``); a job trains in b
    and then one in c, both with the root ``"ckpts"``: each commits into its own directory,
    and b's restart resumes from b's."""
    for d in "abc":
        (tmp_path / d).mkdir()
    agent = _start_agent(agents, cwd=str(tmp_path / "a"))
    try:
        monkeypatch.chdir(tmp_path / "b")
        with ckptd.Checkpointer("ckpts", rank=0, world_size=1, run_id="b1", agent=True) as c:
            assert _served_by(c) == agent.pid
            r = c.save({"w": torch.arange(4.0)}, step=1)
        assert r.url == str(tmp_path / "b" / "ckpts" / layout.step_dir(1))
        with ckptd.Checkpointer("ckpts", rank=0, world_size=1, run_id="b2", agent=True) as c:
            assert c.latest_step() == 1  # the restart finds it
            dst = {"w": torch.zeros(4)}
            assert c.load(dst).step == 1 and torch.equal(dst["w"], torch.arange(4.0))
        monkeypatch.chdir(tmp_path / "c")
        with ckptd.Checkpointer("ckpts", rank=0, world_size=1, run_id="c1", agent=True) as c:
            assert _served_by(c) == agent.pid
            c.save({"w": torch.ones(4)}, step=1)  # not ForeignWriter: c's root is its own
        for d in "bc":
            assert (tmp_path / d / "ckpts" / layout.manifest_path(1)).exists()
        assert not (tmp_path / "a" / "ckpts").exists()
        # and an agent refuses a relative root outright (a trainer of an older ckptd sent them)
        client = AgentClient.connect({"url": "/abs", "options": None}, threads=1, start=False)
        try:
            with pytest.raises(ckptd.CkptdError, match="'ckpts' is a relative root"):
                client._request({"op": "hello", "threads": 1,
                                 "storage": {"url": "ckpts", "options": None}})
        finally:
            client.close()
    finally:
        _stop(agent)


# ----------------------------------------------------------------------------- other code
def _patched_copy(tmp_path, version: str) -> str:
    """A copy of this ckptd whose version says ``version``; the directory to put first on
    PYTHONPATH."""
    site = tmp_path / "other"
    shutil.copytree(os.path.dirname(ckptd.__file__), site / "ckptd",
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = site / "ckptd" / "_version.py"
    text = init.read_text()
    assert f'__version__ = "{ckptd.__version__}"' in text
    init.write_text(text.replace(f'__version__ = "{ckptd.__version__}"',
                                 f'__version__ = "{version}"'))
    return str(site)


def test_an_agent_of_another_ckptd_is_not_used_and_leaves_once_idle(tmp_path, agents, caplog):
    """An agent left by another install (here a patched copy of this one): the trainer saves in
    process with one warning naming the agent's pid and ``ckptd agent --stop``; the agent
    serves the trainer it has to the end and exits once it has none."""
    env = {**os.environ, "PYTHONPATH": _patched_copy(tmp_path, "0.0.1-other")}
    # (run from elsewhere: ``python -m`` puts the working directory, this checkout, first)
    old = _start_agent(agents, env=env, cwd=str(tmp_path))
    try:
        root = str(tmp_path / "root")
        # a trainer of the other install, connected to it (it must not be cut off)
        theirs = subprocess.Popen(
            [sys.executable, "-c", "import sys, ckptd; from ckptd.agent.client import "
             "AgentClient; c = AgentClient.connect({'url': sys.argv[1], 'options': None}, "
             "threads=1, start=False); print('connected', flush=True); sys.stdin.read(); "
             "c.close()", root], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=str(tmp_path))
        assert theirs.stdout.readline().strip() == "connected"
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            with ckptd.Checkpointer(root, rank=0, world_size=1, agent=True) as c:
                assert _served_by(c) is None, agents.log()
                c.save({"w": torch.ones(8)}, step=1)
        said = [r.getMessage() for r in caplog.records if "runs ckptd" in r.getMessage()]
        assert len(said) == 1, said
        assert f"pid {old.pid}" in said[0] and "0.0.1-other" in said[0], said
        assert "ckptd agent --stop" in said[0]
        assert (tmp_path / "root" / layout.manifest_path(1)).exists()
        wait_until(lambda: "retiring" in agents.log(), 30, "the old agent to say it retires")
        assert old.poll() is None, "an agent with a trainer must not leave"
        theirs.stdin.close()
        theirs.wait(timeout=60)
        assert old.wait(timeout=60) == 0  # its last trainer left: it exits
        assert "retiring" in agents.log()
    finally:
        _stop(old)


# ----------------------------------------------------------------------------- errors by class
def _tiny_tmpfs(path, size: str = "1m") -> bool:
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_and_a_foreign_writer_arrive_as_their_classes_through_the_agent(
        tmp_path, agents):
    mnt = tmp_path / "small"
    if not _tiny_tmpfs(mnt):  # root only: otherwise the disk fills by a subclass in process
        pytest.fail("this test mounts a tmpfs (it runs as root here and in CI)")
    try:
        root = str(mnt / "root")
        with ckptd.Checkpointer(root, rank=0, world_size=1, run_id="j", agent=True) as c:
            assert _served_by(c) is not None
            with pytest.raises(ckptd.StorageError, match=r"disk full \(ENOSPC\)") as err:
                c.save({"w": torch.ones(1 << 20)}, step=2)  # 4 MiB into 1 MiB
            assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
            # the failed share does not stay to fill the disk: the next save fits
            c.save({"w": torch.ones(1000)}, step=3)
        root2 = str(tmp_path / "root2")
        with ckptd.Checkpointer(root2, rank=0, world_size=1, run_id="first", agent=True) as c:
            with ckptd.Checkpointer(root2, rank=0, world_size=1, run_id="second",
                                    agent=False):
                pass  # opened: it takes the root over
            with pytest.raises(ckptd.ForeignWriter, match="owned by run second"):
                c.save({"w": torch.ones(4)}, step=1)
    finally:
        # the agent may still hold a directory of it for a moment: detached lazily then,
        # never left mounted
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


# ----------------------------------------------------------------------------- squatters
def test_a_squatted_segment_name_and_a_linked_agent_directory_do_not_stop_the_agent(
        tmp_path, agents, monkeypatch, caplog):
    """Another local user plants a file named like this agent's segments (the sticky
    /dev/shm keeps it there), and a link where the agent directory would be."""
    squat = f"/dev/shm/ckptd-{os.getuid()}-{wire.instance(agents.node)}+squat"
    with open(squat, "wb"):
        pass
    os.chown(squat, 65534, 65534)  # nobody's: this user may not remove it from a sticky dir
    try:
        with ckptd.Checkpointer(str(tmp_path / "r"), rank=0, world_size=1, agent=True) as c:
            assert _served_by(c) is not None, agents.log()
            c.save({"w": torch.ones(4)}, step=1)
        assert "not removable, skipped" in agents.log()
        assert os.path.exists(squat)  # never removed (it could be another user's file)
    finally:
        os.unlink(squat)
    # a link in place of the agent directory: refused, not followed; the trainer saves in process
    target = tmp_path / "victim"
    target.mkdir(mode=0o700)
    link = tmp_path / "linked"
    link.symlink_to(target)
    monkeypatch.setenv("CKPTD_AGENT_DIR", str(link))
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        with ckptd.Checkpointer(str(tmp_path / "r2"), rank=0, world_size=1, agent=True) as c:
            assert _served_by(c) is None
            c.save({"w": torch.ones(4)}, step=1)
    assert any("not a link" in r.getMessage() for r in caplog.records)
    assert os.listdir(target) == []  # nothing was put where the link points


def test_a_timeout_below_two_heartbeats_is_refused(tmp_path, agents, monkeypatch):
    monkeypatch.setenv("CKPTD_AGENT_TIMEOUT_S", "0.2")
    with pytest.raises(ckptd.CkptdError, match=r"CKPTD_AGENT_TIMEOUT_S='0.2': at least 1 s"):
        ckptd.Checkpointer(str(tmp_path / "r"), rank=0, world_size=1, agent=True)


# ----------------------------------------------------------------------------- a flood
def _low_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_a_connection_flood_neither_takes_the_peer_port_down_nor_stops_the_agent(
        tmp_path, agents, monkeypatch):
    """1,100 idle connections to the peer port of an agent limited to 1,024 files, and one
    that sends 2,000-deep JSON instead of its answer: afterwards a peer copy still goes
    through; a trainer that connects during the flood is served; the agent lives, and its log
    did not grow by a line per connection."""
    monkeypatch.setenv("CKPTD_JOB_SECRET", "s3cret-of-this-job")
    agent = _start_agent(agents, preexec=_low_files)
    flood: list[socket.socket] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    try:
        root = str(tmp_path / "root")
        on_a = AgentClient.connect({"url": root, "options": None}, threads=1, start=False)
        with open(os.path.join(root, "_agents", f"{agents.node}.json")) as f:
            me = json.load(f)
        lines_before = agents.log().count("\n")
        deep = socket.create_connection((me["host"], me["port"]), timeout=30)
        wire.recv(deep, 4096)  # the nonce
        payload = ("[" * 2000 + "]" * 2000).encode()
        deep.sendall(len(payload).to_bytes(4, "big") + payload)
        for _ in range(1100):
            flood.append(socket.create_connection((me["host"], me["port"]), timeout=30))
        # a trainer connecting during the flood (another root: its run would own this one,
        # and the agent would drop the copy below as an earlier run's): served by the agent
        with ckptd.Checkpointer(str(tmp_path / "trained"), rank=0, world_size=1,
                                agent=True) as c:
            assert _served_by(c) == agent.pid
            c.save({"w": torch.ones(4)}, step=1)
        # the flood ends; an authenticated peer copy goes through (once the agent has seen
        # the flood's connections close: a peer's copies are retried the same way)
        for s in flood:
            s.close()
        flood.clear()
        from test_agent import _send_as_peer

        def copied() -> bool:
            try:
                return bool(_send_as_peer(me, root, 99, b"x" * 4096, digest_of=b"x" * 4096)["ok"])
            except (OSError, KeyError):
                return False

        wait_until(copied, 30, "a peer copy after the flood")
        assert any("step-000000099" in p for p in on_a.held().files)
        on_a.close()
        assert alive(agent.pid)
        log = agents.log()
        assert "RecursionError" not in log and "Traceback" not in log
        assert log.count("\n") - lines_before < 50, log[-3000:]
    finally:
        for s in flood:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        _stop(agent)
