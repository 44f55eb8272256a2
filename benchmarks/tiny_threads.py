"""Where a tiny save's CPU goes, thread by thread: the saves of ``commit.py`` (W gloo ranks, 4
tensors of 16 KiB a rank, ``keep_last=2``), each rank reading its threads' CPU time and
voluntary context switches (``/proc/self/task/<tid>/schedstat`` and ``status``) before and
after the measured saves.

    python benchmarks/tiny_threads.py [--world 8] [--saves 100] [--runs 3] [--agent]

Prints, per thread name (a pool's workers summed: ``ckptd-io_0`` and ``ckptd-io_1`` are
``ckptd-io``), the CPU and the wake-ups per save on rank 0 (the coordinator) and on the median
other rank, then the whole process's CPU (``time.process_time``), medians over ``--runs``.
Its floor is 0: every figure here is work the fsyncs do not need. The main thread's figure
includes the benchmark's barrier before each save. With ``--agent`` every save goes
through the node agent (``CKPTD_AGENT_MIN_BYTES=0``: by default a save this small is written by
its rank even where an agent runs), whose CPU per save (from ``/proc/<pid>/stat``) is a row of
its own; its threads are not told apart. A thread that ended during the saves is not counted.

CPU time on a shared or virtual machine includes what other work costs this one (cache,
context switches, a host's steal counted as the guest's): compare runs made side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import multirank  # noqa: E402
import torch.distributed as dist  # noqa: E402
from commit import WARMUP, _agent_cpu_s, _tiny_state  # noqa: E402

Usage = dict[str, tuple[float, float]]  # thread name -> (CPU seconds, voluntary switches)


def _threads() -> Usage:
    """This process's Python threads by name (a pool's workers summed)."""
    import threading

    out: dict[str, tuple[float, float]] = {}
    for t in threading.enumerate():
        if t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                switches = next(int(line.split()[1]) for line in f
                                if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue
        name = re.sub(r"[_-]\d+$", "", t.name)
        c, s = out.get(name, (0.0, 0.0))
        out[name] = (c + cpu, s + switches)
    return out


def _rank(rank: int, world: int, root: str, saves: int,
          agent: bool) -> tuple[Usage, float, float]:
    """Per save: each thread's (CPU, wake-ups), the process's CPU, and the agent's (rank 0)."""
    if agent:
        os.environ["CKPTD_AGENT_MIN_BYTES"] = "0"  # every save to the agent, small as it is
    import ckptd

    state = _tiny_state(rank, world)
    with ckptd.Checkpointer(root, keep_last=2, agent=agent) as ckpt:
        for step in range(saves + WARMUP):
            if step == WARMUP:
                before, c0 = _threads(), time.process_time()
                a0 = _agent_cpu_s(ckpt) if agent and rank == 0 else 0.0
            dist.barrier()
            ckpt.save_async(state, step=step).result()
        after, cpu = _threads(), time.process_time() - c0
        agent_s = _agent_cpu_s(ckpt) - a0 if agent and rank == 0 else 0.0
    usage = {n: ((c - before.get(n, (0.0, 0.0))[0]) / saves,
                 (s - before.get(n, (0.0, 0.0))[1]) / saves) for n, (c, s) in after.items()}
    return usage, cpu / saves, agent_s / saves


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--saves", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--agent", action="store_true",
                    help="every save through the node agent (CKPTD_AGENT_MIN_BYTES=0)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="ckptd-threads-", dir=args.dir) as root:
            runs.append(multirank.run(_rank, args.world, root, args.saves, args.agent,
                                      timeout=600))
    names = sorted({n for ranks in runs for usage, _, _ in ranks for n in usage})

    def cell(pick_rank0: bool, name: str, i: int) -> float:
        per_run = []
        for ranks in runs:
            values = [usage.get(name, (0.0, 0.0))[i] for usage, _, _ in ranks]
            per_run.append(values[0] if pick_rank0 else statistics.median(values[1:] or [0.0]))
        return statistics.median(per_run)

    print(f"a tiny save's CPU by thread: W = {args.world} gloo ranks, {args.saves} saves, "
          f"{'through the node agent' if args.agent else 'in process'}; medians of "
          f"{args.runs} runs (floor 0)\n")
    print("| thread | CPU per save, rank 0 | others | wake-ups per save, rank 0 | others |\n"
          "|---|---:|---:|---:|---:|")
    for n in names:
        print(f"| {n} | {cell(True, n, 0) * 1e3:.3f} ms | {cell(False, n, 0) * 1e3:.3f} ms | "
              f"{cell(True, n, 1):.1f} | {cell(False, n, 1):.1f} |")
    process = [[cpu for _, cpu, _ in ranks] for ranks in runs]
    print(f"| whole process | {statistics.median(p[0] for p in process) * 1e3:.3f} ms | "
          f"{statistics.median(statistics.median(p[1:] or [0.0]) for p in process) * 1e3:.3f}"
          " ms | | |")
    if args.agent:
        agent = statistics.median(ranks[0][2] for ranks in runs)
        print(f"| node agent, whole process | {agent * 1e3:.3f} ms | | | |")
        from ckptd.cli import main as cli

        cli(["agent", "--stop"])  # it outlives the runs (it exits after 600 idle s)


if __name__ == "__main__":
    main()
