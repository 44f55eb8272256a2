"""A save being written when its node's SIGTERM lands: how soon the node may die, and when the
step commits — handed to the peer that holds its staged copy, or finished by the node itself.

    python benchmarks/handover.py [--size 1GiB] [--rate 100MB] [--grace 2] [--runs 5]
                                  [--contend 0] [--dir DIR]

Two simulated nodes, a and b, each with its node agent; one trainer on node a (one rank);
``CKPTD_PEER_COPY=staged``. Node a's agent writes at most ``--rate`` bytes/s
(``CKPTD_AGENT_WRITE_RATE``: the node's share of a storage slower than the network — the issue's
140 GB at 1.2 GB/s against 10 GB/s); node b's at the disk's speed. Each run: ``save_async``;
once node b holds the copy, SIGTERM to node a's agent (``--grace`` seconds: less than the rest
of the write needs). Per mode, medians over ``--runs`` runs:

* ``peer``: node a stops its write between two files and node b writes the save from its copy
  (only the job travels);
* ``self``: no job secret, so no peer and no copy: node a finishes the write itself, SIGTERMed
  after the same delay as the paired ``peer`` run.

Columns: **handed over** (runs whose save node b wrote: node a keeps a write it can finish in
the grace left), **copy landed** (``save_async`` → node b holds the copy), **SIGTERM → safe** (the
trainer's ``wait_safe()``: committed, or held by a peer's agent — from then on node a may be
killed), **SIGTERM → committed**, **left at the stop** (node a's log), and the **write floor**
of the whole state (one O_DIRECT stream, before each run): node b writes all of it again.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import common  # noqa: E402
from agent_procs import Agents, alive, wait_until  # noqa: E402

import ckptd  # noqa: E402
from ckptd.agent.client import AgentClient  # noqa: E402

_LEFT = re.compile(r"rank 0 step \d+: stopped with (\d+) of (\d+) bytes to write")


def _holds(spec: dict, node: str, agent_dir: str) -> bool:
    c = AgentClient.connect(spec, threads=1, start=False, node=node, directory=agent_dir)
    try:
        return any("/r00000" in p for p in c.held().files)
    finally:
        c.close()


def one_run(mode: str, state: common.State, rate: float, grace: float, base: str,
            sigterm_after: float | None) -> dict[str, float]:
    """One save through node a's agent, SIGTERMed mid-write; the figures of the docstring."""
    root = tempfile.mkdtemp(prefix=f"handover-{mode}-", dir=base)
    agent_dir = tempfile.mkdtemp(prefix="ckph")  # a socket path is at most 107 bytes
    spec = {"url": root, "options": None}
    env = {"CKPTD_AGENT_DIR": agent_dir, "CKPTD_PEER_COPY": "staged",
           "CKPTD_GRACE_S": str(grace)}
    if mode == "peer":
        env["CKPTD_JOB_SECRET"] = os.urandom(16).hex()
    buf = common.aligned_empty(-(-state.nbytes // 4096) * 4096)  # O_DIRECT: whole blocks
    out: dict[str, float] = {"floor": common.write_fsync(os.path.join(root, "floor.bin"),
                                                         memoryview(buf.numpy()), direct=True)
                             or float("nan")}
    os.remove(os.path.join(root, "floor.bin"))
    agents = Agents(agent_dir, "a")
    on_b = None
    try:
        with common.environ(env):
            if mode == "peer":  # node b's agent, at the disk's speed, serving this root
                on_b = AgentClient.connect(spec, threads=2, node="b", directory=agent_dir)
            with common.environ({"CKPTD_NODE_ID": "a", "CKPTD_AGENT_WRITE_RATE": str(rate)}):
                # opened here: the agent it joins is the node's and the rate's of this block
                ckpt = ckptd.Checkpointer(root, rank=0, world_size=1, agent=True,
                                          run_id="r").open()
            try:
                state.touch()
                t0 = time.perf_counter()
                h = ckpt.save_async(state.ckptd_tree(), step=1)
                if mode == "peer":
                    wait_until(lambda: _holds(spec, "b", agent_dir), 600, "node b's copy")
                    out["landed"] = time.perf_counter() - t0
                else:
                    assert sigterm_after is not None
                    time.sleep(max(0.0, sigterm_after - (time.perf_counter() - t0)))
                os.kill(agents.pid("a"), signal.SIGTERM)
                t_sig = time.perf_counter()
                assert h.wait_safe(600)
                out["safe"] = time.perf_counter() - t_sig
                result = h.result(600)
                out["committed"] = time.perf_counter() - t_sig
                out["handed"] = float(result.handed_to == "b")  # (not: it fit the grace left)
            finally:
                ckpt.close()
            m = _LEFT.search(agents.log("a"))
            out["left"] = int(m.group(1)) if m else float("nan")
    finally:
        for node in ("a", "b"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                pid = agents.pid(node)
                if alive(pid):
                    os.kill(pid, signal.SIGTERM)
                wait_until(lambda pid=pid: not alive(pid), 120, f"node {node}'s agent to exit")
        if on_b is not None:
            on_b.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(agent_dir, ignore_errors=True)
    return out


def _runs(args: argparse.Namespace, size: int, rate: float,
          base: str) -> dict[str, list[dict[str, float]]]:
    """``args.runs`` paired runs of both modes in ``base``."""
    print(common.machine_info(base))
    print(f"state {common.fmt_bytes(size)}, one rank on node a; node a writes at most "
          f"{common.fmt_bytes(rate)}/s; {args.grace:g} s of grace; {args.runs} runs; "
          f"{args.contend} busy processes\n")
    state = common.build_state(size)
    runs: dict[str, list[dict[str, float]]] = {"peer": [], "self": []}
    with common.busy_processes(args.contend):
        for _ in range(args.runs):  # paired: the same SIGTERM delay for both
            runs["peer"].append(one_run("peer", state, rate, args.grace, base, None))
            runs["self"].append(one_run("self", state, rate, args.grace, base,
                                        runs["peer"][-1]["landed"]))
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--rate", default="100MB", help="node a's write rate, per second")
    ap.add_argument("--grace", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--contend", type=int, default=0, help="busy processes meanwhile")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    size, rate = common.parse_size(args.size), float(common.parse_size(args.rate))
    with common.scratch(args.dir) as base:
        runs = _runs(args, size, rate, base)
    print("| mode | handed over | copy landed | SIGTERM → safe | SIGTERM → committed "
          "| left at the stop | write floor (whole state) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, rows in runs.items():
        def med(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r.get(key, float("nan")) for r in rows)

        landed = f"{med('landed'):.2f} s" if mode == "peer" else "—"
        left = common.fmt_bytes(med("left")) if not math.isnan(med("left")) else "—"
        handed = f"{sum(r['handed'] for r in rows):.0f} of {len(rows)}"
        print(f"| {mode} | {handed} | {landed} | {med('safe'):.2f} s | "
              f"{med('committed'):.2f} s | {left} | {med('floor'):.2f} s |", flush=True)


if __name__ == "__main__":
    main()
