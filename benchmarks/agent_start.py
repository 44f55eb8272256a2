"""What the node agent, on by default in a launched job, costs a job's start: a
Checkpointer's open (its first use; constructing one does no I/O).

    python benchmarks/agent_start.py [--runs 5] [--contend N]

Per run, in a fresh agent directory (no agent running): the default in a script run by hand
(no launcher: in process); ``Checkpointer(root, agent=False)``; the default under a launcher
(torchrun's ``TORCHELASTIC_RUN_ID`` set) with no agent running (the first Checkpointer of a
node: it starts the agent and waits for it to listen); the same with that agent running (every
later one). Then
what the first costs is made of: a fresh interpreter importing ``torch`` (what the agent does
before it listens) and one importing ``ckptd.agent.wire`` (what would answer without torch).
Medians of ``--runs``, min–max beside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import common  # noqa: E402
from agent_procs import Agents, alive, wait_until  # noqa: E402

import ckptd  # noqa: E402
from ckptd.agent import wire  # noqa: E402
from ckptd.agent.client import AgentClient  # noqa: E402


def _timed(make: Callable[[], ckptd.Checkpointer]) -> float:
    t = time.perf_counter()
    ckpt = make().open()
    took = time.perf_counter() - t
    ckpt.close()
    return took


def one_run(base: str) -> dict[str, float]:
    agent_dir = tempfile.mkdtemp(prefix="ckas")  # a socket path is at most 107 bytes
    root = tempfile.mkdtemp(dir=base)
    out = {}
    # CKPTD_AGENT empty: the library's default (common.py sets 0 for the other benchmarks):
    # in process for a script run by hand; the agent for a job a launcher started (torchrun's
    # variable, set here)
    for launched in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE"):
        os.environ.pop(launched, None)  # this script is run by hand
    with common.environ({"CKPTD_AGENT_DIR": agent_dir, "CKPTD_AGENT": ""}):
        out["agent=False"] = _timed(lambda: ckptd.Checkpointer(root, agent=False))
        out["default, no launcher"] = _timed(lambda: ckptd.Checkpointer(root))
    with common.environ({"CKPTD_AGENT_DIR": agent_dir, "CKPTD_AGENT": "",
                         "TORCHELASTIC_RUN_ID": "bench"}):
        try:
            out["default, the agent starts"] = _timed(lambda: ckptd.Checkpointer(root))
            out["default, the agent runs"] = _timed(lambda: ckptd.Checkpointer(root))
        finally:
            pid = Agents(agent_dir, wire.node_id()).pid()
            AgentClient.connect({"url": "", "options": None}, threads=1,
                                start=False).stop_agent()
            wait_until(lambda: not alive(pid), 60, "the agent to exit")
            common.remove(agent_dir)
    return out


def _import_s(module: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--contend", type=int, default=0, help="busy processes meanwhile")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    rows: dict[str, list[float]] = {}
    with common.scratch(args.dir) as base, common.busy_processes(args.contend):
        for _ in range(args.runs):
            for k, v in one_run(base).items():
                rows.setdefault(k, []).append(v)
        for module in ("torch", "ckptd.agent.wire"):
            rows[f"a fresh interpreter: import {module}"] = [_import_s(module)
                                                            for _ in range(args.runs)]
    print(f"median of {args.runs} runs; {args.contend} busy processes\n")
    print("| what | median | min–max |\n|---|---:|---:|")
    for k, v in rows.items():
        print(f"| {k} | {statistics.median(v) * 1e3:,.0f} ms | "
              f"{min(v) * 1e3:,.0f}–{max(v) * 1e3:,.0f} ms |")


if __name__ == "__main__":
    main()
