"""When a step's peer copy lands, sent after the commit or while the save is written.

    python benchmarks/peer_copy.py [--size 1GiB] [--world 2] [--saves 5] [--gap 2]
                                   [--contend 0] [--dir DIR]

W gloo ranks, one per simulated node (``CKPTD_NODE_ID`` n0 … n{W-1}), each node with its own
node agent, one job secret: a ring of W agents, each sending its node's part of every step to
the next. Per mode of ``CKPTD_PEER_COPY`` (``committed``: the default; ``staged``), medians over
``--saves`` saves after a warm-up save, ``--gap`` seconds apart, the slowest rank:

* the **stall** (``save_async`` → returned) and **durable** (→ ``result()``), next to the
  **write floor** (the same bytes written with O_DIRECT and fsync by the ranks just before each
  save: the disk's bandwidth drifts);
* **copy landed**: from ``save_async`` to the moment the sending agent logged the copy as
  received by its peer (the agents' log lines, same clock). Until then a node lost with its
  memory takes that step's part with it: the restart reads it from storage, or, if the step has
  not committed, goes back to the step before;
* with ``--contend N``, N processes spin on the cores meanwhile (users' nodes are never idle).

The state is ``common.build_state`` (the same as ``agent.py``), split over the ranks.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import common  # noqa: E402
import multirank  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_COPIED = re.compile(r"^(\S+ \S+) ckptd\.agent INFO ckptd agent: rank (\d+) step (\d+) "
                     r"copied to node")


def _ranks(rank: int, world: int, root: str, size: int, saves: int, gap_s: float,
           env: dict[str, str]) -> tuple[dict[str, float], dict[int, float]]:
    """This rank's saves through its node's agent: medians (slowest rank) and, per step, the
    wall-clock time its ``save_async`` started (for the copies' log lines). ``env``: the
    agents' settings (the ranks fork from a server started once, with the first mode's
    environment; the agent a rank starts inherits the rank's)."""
    import ckptd

    torch.set_num_threads(1)
    os.environ.update(env, CKPTD_NODE_ID=f"n{rank}")
    state = common.build_state(size, rank, world)
    buf = common.aligned_empty(state.nbytes)
    writes, stalls, durable, started = [], [], [], {}
    with ckptd.Checkpointer(os.path.join(root, "ckpt"), keep_last=2, agent=True) as ckpt:
        assert ckpt.executor == "agent", "no agent"
        for step in range(saves + 1):
            # the write floor, the same bytes, before each save and after the same pause (a
            # floor measured in a block before all the saves sees another disk: this virtual
            # one's bandwidth drifts). Even so it is bimodal here: 1 GiB over 2 ranks took
            # 0.65-0.73 s in some runs, 1.8-2.0 s in others (one 3 GiB stream: 0.5 GB/s),
            # while durable stayed at 3.5-3.8 s: read durable / floor with that in mind
            writes.append(common.floor_write(os.path.join(root, f"floor-{rank}.bin"), buf))
            time.sleep(gap_s)
            state.touch()
            dist.barrier()
            started[step] = time.time()
            t0 = time.perf_counter()
            h = ckpt.save_async(state.ckptd_tree(), step=step)
            stall = time.perf_counter() - t0
            h.result()
            done = time.perf_counter() - t0
            time.sleep(gap_s)
            stalls.append(common.slowest(stall))
            durable.append(common.slowest(done))
    return ({"stall": statistics.median(stalls[1:]), "durable": statistics.median(durable[1:]),
             "write": statistics.median(writes[1:])}, started)


def _copies_landed(log_path: str) -> dict[tuple[int, int], float]:
    """(rank, step) -> wall-clock time the agent logged the copy as held by a peer."""
    out = {}
    with open(log_path) as f:
        for line in f:
            m = _COPIED.match(line)
            if m:
                when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
                out[(int(m.group(2)), int(m.group(3)))] = when.timestamp()
    return out


def _stop_agents(agent_dir: str, world: int) -> None:
    """Stop every node's agent and wait until it exited (its memory is several GiB)."""
    from agent_procs import Agents, alive, wait_until

    from ckptd.agent.client import AgentClient

    agents = Agents(agent_dir, "n0")
    for rank in range(world):
        pid = agents.pid(f"n{rank}")
        AgentClient.connect({"url": "", "options": None}, threads=1, start=False,
                            node=f"n{rank}", directory=agent_dir).stop_agent()
        wait_until(lambda pid=pid: not alive(pid), 120, f"agent {pid} to exit")


def run_mode(mode: str, world: int, size: int, saves: int, gap_s: float, base: str,
             contend: int) -> dict[str, float]:
    from ckptd.agent import wire

    root = tempfile.mkdtemp(prefix=f"peer-{mode}-", dir=base)
    agent_dir = tempfile.mkdtemp(prefix="ckpb")  # a socket path is at most 107 bytes
    env = {"CKPTD_AGENT_DIR": agent_dir, "CKPTD_JOB_SECRET": os.urandom(16).hex(),
           "CKPTD_PEER_COPY": mode}
    with common.environ(env):  # for the ``ckptd agent --stop`` calls
        try:
            with common.busy_processes(contend):
                out = multirank.run(_ranks, world, root, size, saves, gap_s, env,
                                    timeout=1800)
            logs = [wire.paths(f"n{rank}", agent_dir)["log"] for rank in range(world)]
            deadline = time.monotonic() + 60  # the last copy may land after the ranks closed
            while True:
                copies = [_copies_landed(log) for log in logs]
                if all((rank, saves) in copies[rank] for rank in range(world)) or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            _stop_agents(agent_dir, world)
            shutil.rmtree(root, ignore_errors=True)
    landed = []
    for step in range(1, saves + 1):
        per_rank = [copies[rank][(rank, step)] - out[rank][1][step] for rank in range(world)
                    if (rank, step) in copies[rank]]
        landed.append(max(per_rank) if len(per_rank) == world else float("nan"))
    shutil.rmtree(agent_dir, ignore_errors=True)
    return {**out[0][0], "landed": statistics.median(landed)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--gap", type=float, default=2.0)
    ap.add_argument("--contend", type=int, default=0, help="busy processes meanwhile")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    size = common.parse_size(args.size)
    with common.scratch(args.dir) as base:
        print(common.machine_info(base))
        print(f"state {common.fmt_bytes(size)} over {args.world} ranks, one per node; "
              f"{args.saves} saves {args.gap:g} s apart; {args.contend} busy processes\n")
        print("| CKPTD_PEER_COPY | stall | durable | write floor | durable / floor | copy landed "
              "| landed − durable |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for mode in ("committed", "staged"):
            f = run_mode(mode, args.world, size, args.saves, args.gap, base, args.contend)
            print(f"| {mode} | {f['stall'] * 1e3:.0f} ms | {f['durable']:.2f} s | "
                  f"{f['write']:.2f} s | {f['durable'] / f['write']:.2f}× | {f['landed']:.2f} s | "
                  f"{f['landed'] - f['durable']:+.2f} s |", flush=True)


if __name__ == "__main__":
    main()
