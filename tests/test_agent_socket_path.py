"""The node agent in a directory whose socket path is longer than a Unix socket address holds
(107 bytes on Linux): a deep ``$CKPTD_AGENT_DIR`` or ``$TMPDIR``. The agent binds, and its
trainers and ``ckptd agent --status`` connect, through a descriptor of the directory; a path
that cannot be reached even so is refused with an error naming it, its length and the setting.

Not in ``SAME_UNDER_EITHER``: the agent executor's pass runs it too, beside the suite's agent.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Iterator

import pytest
import torch
from agent_procs import stop_agents_in

import ckptd
from ckptd.agent import wire
from ckptd.cli import main as cli_main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the node agent runs on Linux")


@pytest.fixture
def deep_agents(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A private agent directory under ``tmp_path`` deep enough that its agent's socket path is
    over the limit, and a node id of this test; every agent started in it is stopped after."""
    d = str(tmp_path / ("deep" * 12) / ("deeper" * 10) / "agents")
    os.makedirs(d, mode=0o700)
    node = f"n{os.getpid()}-{random.randrange(1 << 30)}"
    monkeypatch.setenv("CKPTD_AGENT_DIR", d)
    monkeypatch.setenv("CKPTD_NODE_ID", node)
    monkeypatch.setenv("CKPTD_AGENT", "0")  # the test asks for the agent where it wants it
    assert len(os.fsencode(wire.paths(node, d)["sock"])) > 107
    try:
        yield d, node
    finally:
        stop_agents_in(d, node)


def test_an_agent_directory_too_deep_for_a_socket_address_still_serves_saves(tmp_path,
                                                                          deep_agents, capsys):
    d, node = deep_agents
    root = str(tmp_path / "root")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with ckptd.Checkpointer(root, rank=0, world_size=1, run_id="first", agent=True) as c:
        assert c.executor == "agent"  # not the silent fallback to saving in process
        c.save(state, step=1)
    sock = wire.paths(node, d)["sock"]
    assert os.path.exists(sock)  # the socket is where its path says
    # a restart reads the step from the agent's memory, not from storage
    dst = {"w": torch.zeros(4096)}
    with ckptd.Checkpointer(root, rank=0, world_size=1, run_id="second", agent=True) as c:
        r = c.load(dst)
    assert r.step == 1 and torch.equal(dst["w"], state["w"])
    assert r.nbytes_read > 0 and r.nbytes_from_memory == r.nbytes_read
    # the agent says how it listens
    with open(wire.paths(node, d)["log"]) as f:
        log = f.read()
    assert f"{sock} ({len(os.fsencode(sock))} bytes, over the 107-byte limit of a socket " \
           "address: reached through its directory's descriptor)" in log
    # and the command line reaches it too
    assert cli_main(["agent", "--status", "--json", "--dir", d, "--node", node]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["running"] is True and "error" not in status["agents"][0]


def test_a_socket_name_too_long_even_through_its_directory_is_refused_naming_it(tmp_path):
    # a name of 120 bytes: over the limit whatever directory it is in
    path = str(tmp_path / ("s" * 115 + ".sock"))
    with pytest.raises(ckptd.CkptdError) as e:  # on Linux's own: OSError, 'too long'
        wire.request(path, {"op": "status"}, timeout_s=1.0)
    assert str(e.value) == (
        f"{path}: a Unix socket path of {len(os.fsencode(path))} bytes, over the 107-byte limit "
        "of a socket address even when reached through its directory: set CKPTD_AGENT_DIR to "
        "a shorter directory")
