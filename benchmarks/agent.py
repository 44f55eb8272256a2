"""The node agent against the in-process save: one state over W gloo ranks (local disk).

    python benchmarks/agent.py [--size 2GiB] [--world 4] [--saves 5] [--contend 0,2] [--dir DIR]
                               [--gap 2] [--stall-only]  (--stall-only: no compute loop, no restart)

Per mode (``inproc``: ``agent=False``; ``agent``: every rank hands its staged arena to one node
agent) and per contention level (N busy processes spinning on the cores while the ranks save;
users' nodes are never idle), medians over ``--saves`` saves after a warm-up save, ``--gap``
seconds apart (default 2: real jobs train for minutes between saves, and the previous save's
after-commit work — retention, the agent's bookkeeping — is done by the next; 0: back to back):

* the **stall** (``save_async`` → returned; the slowest rank), and of it the staging **copy**
  (the rest: describing the state, planning, handing the job over), next to the **memcpy
  floor**: each rank copying its state into a preallocated buffer, measured in the same run
  under the same contention;
* **durable** (``save_async`` → every rank's ``result()``) next to the **write floor**: the same
  bytes written and fsync'd by the ranks directly, before each save and after the same pause
  (this disk's floor is bimodal: ``benchmarks/README.md``);
* the **CPU of the write**: every rank's process CPU from the end of its stall to the end of the
  gap after its ``result()`` (in process: its writer threads, and rank 0's retention), plus with
  the agent the agent's CPU over the same time (``/proc/<pid>/stat``) — kernel threads
  (writeback) are in neither.

and the **restart**: the newest step loaded at W - 1 ranks (a node lost, the job restarted
smaller) from the agent's memory (``agent=True``) and from storage with a cold page cache
(``agent=False``, caches dropped when this runs as root), with the bytes each took from memory.

and the **restart to the first step** at W - 1 ranks, the same two ways: ``torchrun`` starts
fresh processes that import torch, join a process group, allocate the state, load it and run one
compute step (wall time from the launch to the first step done on every rank).

and the **compute slowdown**: a training-like loop (``common.Compute``: matmuls and small ops)
run while the save is in flight, its iterations/s against the same loop just before (the slowest
rank's ratio; median over ``--saves`` more saves); its floor: the same loop while another
process (its own session, like the agent) writes the same bytes with O_DIRECT and fsync from
memory it prepared beforehand — what any background write costs training on this machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import common  # noqa: E402
import multirank  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ckptd.agent import wire  # noqa: E402


def _floors(rank: int, world: int, root: str, size: int, saves: int, compute_loop: bool = True
            ) -> dict[str, float]:
    torch.set_num_threads(1)
    state = common.build_state(size, rank, world)
    flat = [lf.local for lf in state.leaves]
    buf = common.aligned_empty(state.nbytes)
    copies, writes = [], []
    for _ in range(saves + 1):
        dist.barrier()
        t0 = time.perf_counter()
        off = 0
        for t in flat:
            n = t.numel() * t.element_size()
            buf[off: off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n
        copies.append(common.slowest(time.perf_counter() - t0))
        if compute_loop:  # how long the compute loop's floor runs; _saves has the table's floor
            writes.append(common.floor_write(os.path.join(root, f"floor-{rank}.bin"), buf))
    return {"memcpy": statistics.median(copies[1:]),
            "slowdown": (_floor_slowdown(rank, root, size, saves, statistics.median(writes[1:]))
                         if compute_loop else float("nan"))}


# the write floor as another process does it: the whole state (every rank's share) from memory
# it allocated and touched beforehand, O_DIRECT + fsync, in a session of its own (as the agent)
_WRITER = """
import sys
sys.path.insert(0, sys.argv[3])
import common
buf = common.aligned_empty(int(sys.argv[2]))
buf.fill_(1)
print("ready", flush=True)
sys.stdin.readline()
common.write_fsync(sys.argv[1], memoryview(buf.numpy()), direct=True)
"""


def _floor_slowdown(rank: int, root: str, size: int, saves: int, write_s: float) -> float:
    """The compute loop's slowdown while another process writes the same bytes: the least a
    background write can take from training on this machine (median over ``saves``)."""
    compute = common.Compute()
    ratios = []
    for i in range(saves):
        writer = None
        if rank == 0:
            writer = subprocess.Popen(
                [sys.executable, "-c", _WRITER, os.path.join(root, f"floor-w{i}.bin"), str(size),
                 HERE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                start_new_session=True)
            assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        dist.barrier()
        idle = compute.rate_for(1.0)
        dist.barrier()
        if writer is not None:
            assert writer.stdin is not None
            writer.stdin.write("go\n")
            writer.stdin.flush()
        busy = compute.rate_for(0.8 * write_s)  # inside the write (it takes ~the floor)
        ratios.append(common.slowest(idle / busy))
        if writer is not None:
            writer.communicate()
            os.remove(os.path.join(root, f"floor-w{i}.bin"))
    return statistics.median(ratios)


def _saves(rank: int, world: int, root: str, size: int, saves: int, agent: bool,
           compute_loop: bool = True, gap_s: float = 0.0, keep_last: int = 2
           ) -> dict[str, float]:
    import ckptd

    torch.set_num_threads(1)
    state = common.build_state(size, rank, world)
    buf = common.aligned_empty(state.nbytes)
    floor_path = os.path.join(os.path.dirname(root), f"floor-{rank}.bin")
    stalls, copies, durable, write_cpu, writes = [], [], [], [], []
    copied = _time_staging_copies()
    with ckptd.Checkpointer(root, keep_last=keep_last, agent=agent) as ckpt:
        assert agent == (ckpt.executor == "agent")
        agent_pid = (wire.lock_pid(wire.paths(wire.node_id(), wire.agent_dir())["lock"])
                     if agent else None)
        ckpt.reserve(state.ckptd_tree())
        for step in range(saves + 1):
            # the write floor before each save, after the same pause (benchmarks/README.md:
            # this disk's floor is bimodal and drifts; one measured in a block before the saves
            # may be in the other mode)
            writes.append(common.floor_write(floor_path, buf))
            time.sleep(gap_s)
            state.touch()
            dist.barrier()
            a0 = _cpu_of(agent_pid) if agent_pid and rank == 0 else 0.0
            copied[0] = 0.0
            t0 = time.perf_counter()
            h = ckpt.save_async(state.ckptd_tree(), step=step)
            stall = time.perf_counter() - t0
            copy = copied[0]
            c0 = time.process_time()
            h.result()
            done = time.perf_counter() - t0
            # the training between two saves (minutes in real jobs): the previous save's
            # after-commit work (retention, the agent's bookkeeping) is done before the next
            time.sleep(gap_s)
            mine = time.process_time() - c0  # this process after the stall (its writers)
            dist.barrier()
            if agent_pid and rank == 0:
                mine += _cpu_of(agent_pid) - a0  # the agent's, for every rank of the node
            stalls.append(common.slowest(stall))
            copies.append(common.slowest(copy))
            durable.append(common.slowest(done))
            write_cpu.append(common.slowest(mine, dist.ReduceOp.SUM))
        # the training loop beside the background write: iterations/s while the save is in
        # flight against the same loop with nothing in flight, measured just before
        compute = common.Compute()
        slowdowns = []
        for step in range(saves + 1, 2 * saves + 1) if compute_loop else ():
            state.touch()
            dist.barrier()
            idle = compute.rate_for(1.0)
            dist.barrier()
            h = ckpt.save_async(state.ckptd_tree(), step=step)
            busy, _, _ = compute.rate_until(h.done)
            h.result()
            slowdowns.append(common.slowest(idle / busy))
    return {"stall": statistics.median(stalls[1:]), "copy": statistics.median(copies[1:]),
            "durable": statistics.median(durable[1:]), "write": statistics.median(writes[1:]),
            "slowdown": statistics.median(slowdowns) if slowdowns else float("nan"),
            "write_cpu": statistics.median(write_cpu[1:])}


def _time_staging_copies() -> list[float]:
    """Wrap the staging copy (``ckptd.writer.pipeline.stage``, where the Saver calls it in the
    caller's thread, for both executors) to add its seconds to the returned cell: the stall is
    that copy plus the rest (describe, plan, the job's hand-over)."""
    from ckptd.writer import save as save_mod

    cell = [0.0]

    def timed(fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cell[0] += time.perf_counter() - t0
        return run

    save_mod.stage = timed(save_mod.stage)  # type: ignore[attr-defined]
    return cell


def _ratio(x: float) -> str:
    return "—" if x != x else f"{x:.2f}×"  # NaN: not measured (--stall-only)


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loads(rank: int, world: int, root: str, size: int, agent: bool) -> dict[str, float]:
    import ckptd

    torch.set_num_threads(1)
    state = common.build_state(size, rank, world)
    for lf in state.leaves:
        lf.local.zero_()
    with ckptd.Checkpointer(root, keep_last=2, agent=agent) as ckpt:
        dist.barrier()
        t0 = time.perf_counter()
        r = ckpt.load(state.ckptd_tree(), strict=False)
        took = common.slowest(time.perf_counter() - t0)
    return {"load": took, "read": r.nbytes_read, "memory": r.nbytes_from_memory}


def _first_step(root: str, size: int, agent: bool, t0: float) -> None:
    """One restarted rank (under torchrun): join, allocate, load, one compute step."""
    import json

    import ckptd

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    state = common.build_state(size, rank, world, fill=False)
    with ckptd.Checkpointer(root, keep_last=2, agent=agent) as ckpt:
        r = ckpt.load(state.ckptd_tree(), strict=False)
    common.Compute().step()
    dist.barrier()
    took = common.slowest(time.time() - t0)
    counts = torch.tensor([r.nbytes_from_memory + r.nbytes_from_peer, r.nbytes_read],
                          dtype=torch.float64)
    dist.all_reduce(counts)  # over the ranks: bytes from memory, bytes read
    if rank == 0:
        print(json.dumps({"first_step_s": took, "memory": counts[0].item(),
                          "read": counts[1].item()}), flush=True)
    dist.destroy_process_group()


def _restart(root: str, size: int, world: int, agent: bool) -> dict[str, float]:
    import json
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", os.path.abspath(__file__), "--first-step", root,
           "--size", str(size), "--t0", repr(time.time())] + (["--agent"] if agent else [])
    p = subprocess.run(cmd, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise SystemExit(f"restart failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def _source(agent: bool) -> str:
    """Where a restart reads from; for storage, the page cache is dropped first if possible."""
    if agent:
        return "memory (agent)"
    return "storage, cold cache" if common.drop_caches() else "storage"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--contend", default="0,2", help="busy processes, comma-separated")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--gap", type=float, default=2.0,
                    help="seconds between a save's result() and the next save (0: back to back)")
    ap.add_argument("--keep-last", type=int, default=2,
                    help="the Checkpointer's keep_last (retention after every save)")
    ap.add_argument("--stall-only", action="store_true",
                    help="only the save rows, without the compute loop (faster)")
    ap.add_argument("--first-step", default=None, help=argparse.SUPPRESS)  # a restarted rank
    ap.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = common.parse_size(args.size)
    if args.first_step:
        _first_step(args.first_step, size, args.agent, args.t0)
        return
    rows = []
    loads: list[tuple[str, list[dict[str, float]]]] = []
    restarts: list[tuple[str, dict[str, float]]] = []
    with common.scratch(args.dir) as base, \
            tempfile.TemporaryDirectory(prefix="ckptd-agent-", dir=base) as root:
        agent_dir = tempfile.mkdtemp(prefix="ckab")
        os.environ.update(CKPTD_AGENT_DIR=agent_dir, CKPTD_NODE_ID="bench")
        try:
            for busy in (int(x) for x in args.contend.split(",")):
                with common.busy_processes(busy):
                    fl = multirank.run(_floors, args.world, root, size, args.saves,
                                       not args.stall_only, timeout=1800)[0]
                    saved = os.path.join(root, f"c{busy}")  # the agent's saves, loaded below
                    for agent in (False, True):
                        into = saved if agent else saved + "-in-process"
                        r = multirank.run(_saves, args.world, into, size, args.saves, agent,
                                          not args.stall_only, args.gap, args.keep_last,
                                          timeout=1800)[0]
                        rows.append((busy, "agent" if agent else "in process", r, fl))
                        if not agent:
                            shutil.rmtree(into)
                    if busy == 0 and args.world > 1 and not args.stall_only:  # at world - 1
                        for agent in (True, False):
                            loads.append((_source(agent), multirank.run(
                                _loads, args.world - 1, saved, size, agent, timeout=1800)))
                        for agent in (True, False):
                            restarts.append((_source(agent),
                                             _restart(saved, size, args.world - 1, agent)))
        finally:
            from ckptd.agent.client import AgentClient

            try:
                AgentClient.connect({"url": "", "options": None}, threads=1,
                                    start=False).stop_agent()
            except Exception:  # noqa: BLE001 - none was started
                pass
            shutil.rmtree(agent_dir, ignore_errors=True)
    print(f"{common.fmt_bytes(size)} over {args.world} gloo ranks, median of {args.saves} "
          "saves (slowest rank)\n")
    print("| busy processes | mode | stall | of it the copy | memcpy floor | stall / floor | "
          "durable | "
          "write floor | durable / floor | compute slowdown during the write | "
          "CPU of the write (every rank after its stall, and the agent) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for busy, mode, r, fl in rows:
        print(f"| {busy} | {mode} | {r['stall'] * 1e3:.0f} ms | {r['copy'] * 1e3:.0f} ms | "
              f"{fl['memcpy'] * 1e3:.0f} ms | "
              f"{r['stall'] / fl['memcpy']:.2f}× | {r['durable'] * 1e3:.0f} ms | "
              f"{r['write'] * 1e3:.0f} ms | {r['durable'] / r['write']:.2f}× | "
              f"{_ratio(r['slowdown'])} (floor {_ratio(fl['slowdown'])}) | "
              f"{r['write_cpu']:.2f} s |")
    if loads:
        print(f"\nrestart at {args.world - 1} ranks: load of the newest step (slowest rank)\n")
        print("| from | load | bytes read | from memory |\n|---|---:|---:|---:|")
        for name, ld in loads:
            read = sum(x["read"] for x in ld)
            mem = sum(x["memory"] for x in ld)
            print(f"| {name} | {ld[0]['load'] * 1e3:.0f} ms | {common.fmt_bytes(read)} | "
                  f"{common.fmt_bytes(mem)} |")

    if restarts:
        print(f"\nrestart at {args.world - 1} ranks under torchrun: launch to the first step "
              "(every rank)\n")
        print("| from | first step | bytes read | from memory |\n|---|---:|---:|---:|")
        for name, rs in restarts:
            print(f"| {name} | {rs['first_step_s'] * 1e3:.0f} ms | "
                  f"{common.fmt_bytes(rs['read'])} | {common.fmt_bytes(rs['memory'])} |")


if __name__ == "__main__":
    main()
