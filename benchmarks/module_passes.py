"""Which ckptd modules a save, a load and an offline reshard pass through (every thread), and
which modules call back into a module that called them, through others (A -> B -> A, counted
once per pair): a measure of how scattered the paths are and of back-references.

    python benchmarks/module_passes.py          # by module
    PKG=1 python benchmarks/module_passes.py    # by package

Paths traced:

* ``save (in process)``: ``save_async(...)`` and ``result()`` with ``agent=False``;
* ``save (agent)``: the same with the node agent: the trainer's side here, and the agent's side
  in the agent process — started by this script under the same tracer (``--serve-agent``),
  which records the threads that run a save job (``ckptd-job-*``, ``ckptd-aio-*``) and writes
  what they crossed when it stops; the two sides' modules together;
* ``load``: ``load(...)`` of the step saved;
* ``reshard``: ``ckptd reshard ROOT --to-world 2 --out NEW`` (the command's function, in this
  process).

To compare with another commit: ``git worktree add /tmp/old <commit>`` and run this script with
``PYTHONPATH=/tmp/old`` from /tmp/old (``python -m`` and a script both put the working
directory first on the path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

BY_PACKAGE = os.environ.get("PKG") == "1"
_recording: dict[str, Any] = {"on": False, "seq": [], "threads": None}
_lock = threading.Lock()


def _name(frame: Any) -> str:
    mod = frame.f_globals.get("__name__", "")
    return ".".join(mod.split(".")[:2]) if BY_PACKAGE else mod


def _profile(frame: Any, event: str, arg: Any) -> None:
    """Each call into a ckptd module: the module, and whether it is a call *back*: a module
    further up the stack (not the caller's own) called, through others, into a module that
    now calls it again (A -> B -> A)."""
    if event != "call" or not _recording["on"]:
        return
    mod = _name(frame)
    if not mod.startswith("ckptd"):
        return
    only = _recording["threads"]
    if only is not None and not threading.current_thread().name.startswith(only):
        return
    caller, back = None, None
    f = frame.f_back
    while f is not None:
        up = _name(f)
        if up.startswith("ckptd"):
            if caller is None:
                caller = up
            elif up == mod and caller != mod:
                back = (mod, caller)
                break
        f = f.f_back
    with _lock:
        _recording["seq"].append((mod, back))


def _start_tracing(threads: tuple[str, ...] | None = None) -> None:
    _recording["threads"] = threads
    threading.setprofile(_profile)  # threads started from now on (the I/O pools included)
    sys.setprofile(_profile)


def summary(seq: list[Any]) -> tuple[list[str], int, list[str]]:
    """(modules called, calls, the distinct A -> B -> A returns as "A<-B")."""
    mods = sorted({m for m, _ in seq})
    backs = sorted({f"{a}<-{b}" for _, ab in seq if ab for a, b in [ab]})
    return mods, len(seq), backs


def trace(fn: Callable[[], object]) -> list[Any]:
    _recording["seq"] = seq = []
    _recording["on"] = True
    try:
        fn()
    finally:
        _recording["on"] = False
    return seq


def report(what: str, result: tuple[list[str], int, list[str]]) -> dict[str, Any]:
    mods, calls, backs = result
    print(f"{what}: {len(mods)} modules, {len(backs)} A->B->A returns ({calls} calls)")
    print("   ", " ".join(m.replace("ckptd.", "") for m in mods))
    for b in backs:
        print("    return:", b.replace("ckptd.", ""))
    return {"path": what, "modules": len(mods), "returns": backs, "names": mods}


def serve_agent(out: str) -> None:
    """The node agent under the tracer, recording its save threads; their sequence to ``out``
    when it stops."""
    _start_tracing(("ckptd-job", "ckptd-aio"))
    _recording["on"] = True
    from ckptd.agent.__main__ import main as agent_main

    try:
        agent_main(sys.argv[3:])
    finally:
        _recording["on"] = False
        with open(out, "w") as f:
            json.dump(_recording["seq"], f)  # (pairs become lists)


def _agent_save(root: str, state: dict[str, Any], scratch: str) -> list[Any]:
    """The trainer's side of a save through the agent, and the agent's (its trace file)."""
    import ckptd
    from ckptd.agent import wire

    out = os.path.join(scratch, "agent-trace.json")
    env = {**os.environ, "CKPTD_AGENT_DIR": os.path.join(scratch, "agents"),
           "CKPTD_NODE_ID": "trace"}
    os.makedirs(env["CKPTD_AGENT_DIR"], mode=0o700)
    os.environ.update(CKPTD_AGENT_DIR=env["CKPTD_AGENT_DIR"], CKPTD_NODE_ID="trace")
    agent = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-agent", out,
                              "--node", "trace", "--dir", env["CKPTD_AGENT_DIR"]], env=env,
                             stderr=subprocess.DEVNULL)
    sock = wire.paths("trace", env["CKPTD_AGENT_DIR"])["sock"]
    try:
        while not os.path.exists(sock):
            assert agent.poll() is None, "the traced agent exited"
            time.sleep(0.05)
        ck = ckptd.Checkpointer(os.path.join(root, "agent"), keep_last=0, agent=True)
        assert getattr(ck, "executor", "agent") == "agent"  # (older ckptds lack it)
        ck.save(state, step=0)  # warm
        trainer = trace(lambda: ck.save_async(state, step=1).result())
        ck.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=120)
    with open(out) as f:
        agent_side = [(m, tuple(b) if b else None) for m, b in json.load(f)]
    return trainer + agent_side


def main() -> None:
    import torch

    import ckptd
    from ckptd.cli import main as ckptd_command

    _start_tracing()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = os.path.join(scratch, "root")
        state = {"model": {"w": torch.randn(256, 256)}, "step": 1}
        ck = ckptd.Checkpointer(root, keep_last=0, agent=False)  # the in-process path
        ck.save(state, step=0)  # warm: imports, arenas
        rows.append(report("save (in process)",
                           summary(trace(lambda: ck.save_async(state, step=1).result()))))
        dst = {"model": {"w": torch.zeros(256, 256)}, "step": 0}
        ck.load(dst)
        rows.append(report("load", summary(trace(lambda: ck.load(dst)))))
        ck.close()
        rows.append(report("save (agent: trainer and agent)",
                           summary(_agent_save(scratch, state, scratch))))
        out = os.path.join(scratch, "resharded")
        rows.append(report("reshard", summary(trace(
            lambda: ckptd_command(["reshard", root, "--to-world", "2", "--out", out])))))
    if os.environ.get("JSON"):
        print(json.dumps(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-agent"]:
        serve_agent(sys.argv[2])
    else:
        main()
