"""The fixed cost of a save: a tiny state on W gloo ranks (local disk), from the call to every
rank's ``result()``; that is the commit protocol plus a few small files, nothing else.

    python benchmarks/commit.py [--world 8] [--saves 30] [--runs 3] [--contend N] [--dir DIR]

Each save: all ranks pass a barrier, call ``save_async`` on 4 small tensors (16 KiB a rank) and
wait for ``result()`` (``keep_last=2``: retention runs after every commit); the figure is the
slowest rank's time (an all-reduce MAX after the save). Prints the median and the 90th
percentile over ``--saves`` saves (the first two are warm-up and dropped), next to the floor:
the fsyncs durability needs (docs/format.md, *Fsyncs*) done by the ranks directly — a data
file and a frame table fsync'd on every rank, a partial written and renamed; after a barrier
standing for the protocol's wait, rank 0's manifest fsync'd, renamed, its directory fsync'd,
and ``latest`` renamed — and the fsyncs each rank's save made (counted by a storage subclass).
The CPU column is each rank's ``time.process_time()`` over the same window (its median over the
saves: rank 0, and the median of the other ranks); the last line also sums it over the ranks:
W processes on fewer cores make the save CPU-bound, so this is the figure that noise from
other work on the machine affects least.
``--runs`` alternates floor and saves that many times; the last line gives the medians of the
runs' medians, and as the ratio the median of the runs' own ratios (each run's saves against
the floor measured just before them, on a host in the same state), then the ratio of the two
medians. Each run starts with a host probe: the time of a fixed pure-Python loop, which moves
by half or more within minutes on a shared virtual machine. ``--contend N``: N processes
spin on the cores throughout the floor and the saves (users' nodes are never idle; a busy host
made reproducible).

The cost of waiting (``--wait-s``, 10 s; 0 skips it): in one process, rank 1 of a 2-rank job
saves and waits for the commit while rank 0 saves only ``--wait-s`` seconds later (the main
thread sleeping meanwhile); the process's CPU time (``time.process_time``) over that window,
per second of waiting, is what a rank's wait costs (no c10d store: storage only), against a
floor of 0. Median of ``--runs``.

The codec (``--codec [T]``, instead of the rest): one save of the tiny state, and one of T
small tensors a rank (2,000), on W gloo ranks; then, in this process, the thread CPU time of
decoding rank 1's partial as the coordinator does (``decode(raw, path, eager=True)``) and of
encoding it again (``Manifest.encode``), and of the tiny save's manifest, each next to its
floor: ``json.loads`` of the same bytes and ``json.dumps`` of what it gives (compact), with no
checks and no records. Medians of ``--runs`` runs, each the least of 7 rounds; the ratio to
the floor is the figure that other work on the machine moves least.

Where a tiny save's time goes (``--timeline``, instead of the rest): the same saves, each
rank stamping (``time.time()``, one clock for all) when its staging, its partial and, on rank 0,
the merge and the commit start or end — wrappers around those functions, nothing else changed —
and the median over the saves of each event's time after the barrier (the slowest rank's, or
the median rank's where said).

With the node agent (``--agent``): the same saves on the default path on Linux, where this
node's agent runs, and a rank's save under ``$CKPTD_AGENT_MIN_BYTES`` (default 1 MiB: these
saves) is written by the rank itself. ``--agent every``: ``CKPTD_AGENT_MIN_BYTES=0``, the agent
process writes and commits every rank's share. The fsyncs are not counted (the ranks' storage is
the agent's to open); rank 0's CPU column includes the agent's CPU per save, from ``/proc``.
The agent is stopped at the end.

The lag (``--lag``, 30 waits; 0 skips it): in one process, a waiter polls a directory with the
commit protocol's poller while a thread renames a name into it 13 ms later; the figure is the
time from the rename's return to the poll that sees it, without and with the storage's watch
(``Storage.watch``: inotify), against a floor of 0.
"""

from __future__ import annotations

import argparse
import math
import os
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

WARMUP = 2


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _tiny_state(rank: int, world: int) -> dict[str, object]:
    """4 small tensors, 16 KiB a rank, each sharded along dim 0 over the ``world`` ranks."""
    import ckptd

    return {f"w{i}": ckptd.Shard(torch.full((16, 64), float(rank)), (16 * world, 64),
                                 (16 * rank, 0)) for i in range(4)}


def _agent_cpu_s(ckpt: object) -> float:
    """CPU seconds (user + system) the node agent serving ``ckpt`` has used so far."""
    pid = ckpt._saver.executor.client.pid  # type: ignore[attr-defined]
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _save_rank(rank: int, world: int, root: str, saves: int,
               agent: str | None = None) -> tuple[list[float], float, float]:
    """With ``agent``, the default path on Linux (``"every"``: every save through the agent):
    the fsyncs are not counted (nan); rank 0's CPU then includes the agent's, per save."""
    if agent == "every":
        os.environ["CKPTD_AGENT_MIN_BYTES"] = "0"
    import ckptd
    from ckptd.storage.local import LocalStorage

    class Counted(LocalStorage):
        syncs = 0

        def _sync(self, fd: int) -> None:
            Counted.syncs += 1
            super()._sync(fd)

    state = _tiny_state(rank, world)
    out, cpu = [], []
    where = {"agent": True} if agent else {"storage": Counted(root), "agent": False}
    with ckptd.Checkpointer(root, keep_last=2, **where) as ckpt:  # type: ignore[arg-type]
        for step in range(saves + WARMUP):
            if step == WARMUP:
                Counted.syncs = 0
                agent_s = _agent_cpu_s(ckpt) if agent and rank == 0 else 0.0
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            ckpt.save_async(state, step=step).result()
            cpu.append(time.process_time() - c0)
            out.append(_slowest(time.perf_counter() - t0))
        if agent and rank == 0:
            agent_s = (_agent_cpu_s(ckpt) - agent_s) / saves
    own = statistics.median(cpu[WARMUP:])
    if agent:
        return out[WARMUP:], math.nan, own + (agent_s if rank == 0 else 0.0)
    return out[WARMUP:], Counted.syncs / saves, own


def _host_probe() -> float:
    """Seconds of a fixed pure-Python loop (the least of 5): how fast this host's CPU runs
    just now. On this project's shared virtual machines it moved by half or more within
    minutes, and every figure here with it: runs with different probes did not run on the
    same machine, in effect."""
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        x = 0
        for i in range(200_000):
            x += i
        best = min(best, time.perf_counter() - t0)
    return best


def _write(d: str, name: str, data: bytes, *, sync: bool) -> None:
    """``name`` in ``d`` by temp file + rename, its bytes fsync'd with ``sync``."""
    tmp = os.path.join(d, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, name))


def _floor_rank(rank: int, world: int, root: str,
                saves: int) -> tuple[list[float], float, float]:
    """The fsyncs a save needs (docs/format.md, *Fsyncs*), done directly, with a barrier
    standing for the protocol's wait."""
    payload = os.urandom(16 << 10)
    out, cpu = [], []
    for step in range(saves + WARMUP):
        d = os.path.join(root, f"floor-{step}")
        os.makedirs(d, exist_ok=True)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for name in (f"{rank}.bin", f"{rank}.frames"):
            with open(os.path.join(d, name), "wb") as f:
                f.write(payload if name.endswith(".bin") else payload[:256])
                f.flush()
                os.fsync(f.fileno())
        _write(d, f"{rank}.json", payload[:2048], sync=False)  # the partial
        dist.barrier()
        if rank == 0:
            _write(d, "manifest.json", payload[:4096], sync=True)
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _write(d, "latest", payload[:16], sync=False)
        dist.barrier()
        cpu.append(time.process_time() - c0)
        out.append(_slowest(time.perf_counter() - t0))
    return out[WARMUP:], (4.0 if rank == 0 else 2.0), statistics.median(cpu[WARMUP:])


def _wait_cpu(root: str, wait_s: float) -> tuple[float, int]:
    """CPU seconds per second of waiting for a commit, and the polls counted."""
    import ckptd
    from ckptd.storage.local import LocalStorage

    class Counted(LocalStorage):
        reads = 0

        def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
            Counted.reads += path.endswith("manifest.json")
            return super().read_ranges(path, ranges)

        def exists(self, path: str) -> bool:
            Counted.reads += path.endswith("manifest.json")
            return super().exists(path)

    state = {"w": torch.ones(16)}
    with ckptd.Checkpointer(root, rank=0, world_size=2, run_id="wait", keep_last=0) as c0, \
            ckptd.Checkpointer(root, rank=1, world_size=2, run_id="wait", keep_last=0,
                               storage=Counted(root)) as c1:
        h1 = c1.save_async(state, step=1)
        t0 = time.process_time()
        time.sleep(wait_s)
        cpu = time.process_time() - t0
        c0.save_async(state, step=1).result()
        h1.result()
    return cpu / wait_s, Counted.reads


def _lag(root: str, waits: int, watched: bool) -> list[float]:
    """Seconds from a name's rename into a directory (13 ms into a wait) to the waiter's next
    poll seeing it: the commit protocol's poller, with the storage's watch or without."""
    import threading

    from ckptd.storage.local import LocalStorage
    from ckptd.storage.watch import no_watch
    from ckptd.writer.commit import Poller

    st = LocalStorage(root)
    out = []
    for i in range(waits):
        d = f"lag-{watched}-{i}"
        st.put_atomic(f"{d}/first", b"1")
        written: list[float] = []

        def later(d: str = d, written: list[float] = written) -> None:
            time.sleep(0.013)
            st.put_visible(f"{d}/second", b"2")  # a rename, no fsync after it
            written.append(time.perf_counter())

        with st.watch([d]) if watched else no_watch() as watch:
            writer = threading.Thread(target=later)
            writer.start()
            poller = Poller(st, 60.0, watch=watch)
            while "second" not in st.list_dir(d):
                poller.wait()
            seen = time.perf_counter()
        writer.join()
        out.append(seen - written[0])  # < 0: seen before the writer's own fsync returned
    return out


def _timeline_rank(rank: int, world: int, root: str, saves: int) -> list[dict[str, float]]:
    """Per save: seconds after the barrier at which this rank's events happened."""
    import functools

    import ckptd
    from ckptd.writer import commit, pipeline, save

    events: dict[str, float] = {}

    def stamp(owner: object, name: str, start: str | None, end: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def wrapped(*a, **k):  # type: ignore[no-untyped-def]
            if start is not None:
                events.setdefault(start, time.time())
            try:
                return f(*a, **k)
            finally:
                events.setdefault(end, time.time())
        setattr(owner, name, wrapped)

    stamp(save.Saver, "_stage", None, "staged")
    stamp(pipeline.RankWriter, "write_partial", None, "partial written")
    stamp(commit, "commit_partials", "merge starts", "committed")
    stamp(commit, "commit", "manifest write starts", "manifest written")
    state = _tiny_state(rank, world)
    out = []
    with ckptd.Checkpointer(root, keep_last=2, agent=False) as ckpt:  # as the saves above
        for step in range(saves + WARMUP):
            dist.barrier()
            events.clear()
            t0 = time.time()
            ckpt.save_async(state, step=step).result()
            events["result"] = time.time()
            out.append({k: v - t0 for k, v in events.items()})
    return out[WARMUP:]


def _timeline(world: int, saves: int, where: str | None) -> None:
    with tempfile.TemporaryDirectory(prefix="ckptd-timeline-", dir=where) as root:
        ranks = multirank.run(_timeline_rank, world, root, saves, timeout=600)
    print(f"where a tiny save's time goes: W = {world} gloo ranks, {saves} saves, median over "
          "the saves of each event's time after the barrier\n")
    print("| event | ms after the barrier |\n|---|---:|")
    rows = [("staged (slowest rank)", "staged", max),
            ("partial written (median rank)", "partial written", statistics.median),
            ("partial written (slowest rank)", "partial written", max),
            ("rank 0: merge starts", "merge starts", max),
            ("rank 0: manifest write starts", "manifest write starts", max),
            ("rank 0: manifest written", "manifest written", max),
            ("result() returned (median rank)", "result", statistics.median),
            ("result() returned (rank 0)", "result", lambda xs: xs[0]),
            ("result() returned (slowest rank)", "result", max)]
    for label, key, pick in rows:
        per_save = [pick([r[i][key] for r in ranks if key in r[i]])  # type: ignore[operator]
                    for i in range(len(ranks[0]))]
        print(f"| {label} | {statistics.median(per_save) * 1e3:.2f} |")


def _codec_rank(rank: int, world: int, root: str, tensors: int) -> int:
    """One save of the tiny state (``tensors`` = 0) or of ``tensors`` small tensors a rank."""
    import ckptd

    state = _tiny_state(rank, world) if tensors == 0 else {
        f"layers.{i}.w": ckptd.Shard(torch.full((4, 8), float(rank)), (4 * world, 8),
                                     (4 * rank, 0)) for i in range(tensors)}
    with ckptd.Checkpointer(root, keep_last=0, agent=False) as ckpt:
        ckpt.save_async(state, step=1).result()
    return 0


def _cpu_us(fn: object, reps: int) -> float:
    """Thread CPU time of one call of ``fn``, in µs: the least of 7 rounds of ``reps`` (the
    round least slowed by other work on the machine; its cache and memory bandwidth are
    shared even when the core is not)."""
    rounds = []
    for _ in range(7):
        c0 = time.thread_time()
        for _ in range(reps):
            fn()  # type: ignore[operator]
        rounds.append((time.thread_time() - c0) / reps * 1e6)
    return min(rounds)


def _codec(world: int, tensors: int, runs: int, where: str | None) -> None:
    import glob
    import json

    from ckptd.manifest.parse import decode

    print(f"a partial's and a manifest's decode and encode (thread CPU, µs per call, median of "
          f"{runs} runs): the partials of one save on W = {world} gloo ranks\n")
    print("| file | bytes | decode (eager) | floor: json.loads | × floor | encode | "
          "floor: json.dumps | × floor |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, label in ((0, "tiny save (4 tensors of 16 KiB a rank)"),
                     (tensors, f"{tensors} tensors of 128 B a rank")):
        with tempfile.TemporaryDirectory(prefix="ckptd-codec-", dir=where) as root:
            multirank.run(_codec_rank, world, root, n, timeout=600)
            [manifest] = glob.glob(f"{root}/step-*/manifest.json")
            partials = sorted(glob.glob(f"{root}/step-*/ranks/*/*.json"))
            files = [(f"{label}: partial of rank 1", partials[1])]
            if n == 0:
                files.append((f"{label}: manifest", manifest))
            for name, path in files:
                with open(path, "rb") as f:
                    raw = f.read()
                m = decode(raw, path, eager=True)
                assert m.encode() == raw
                doc = json.loads(raw)
                reps = max(1, 200_000 // len(raw))
                fns = (lambda raw=raw, path=path: decode(raw, path, eager=True),
                       lambda raw=raw: json.loads(raw), m.encode,
                       lambda doc=doc: json.dumps(doc, separators=(",", ":")))
                figures = [[_cpu_us(fn, reps) for fn in fns] for _ in range(runs)]
                dec, loads, enc, dumps = (statistics.median(f[i] for f in figures)
                                          for i in range(4))
                print(f"| {name} | {len(raw):,} | {dec:,.1f} | {loads:,.1f} | {dec / loads:.1f} | "
                      f"{enc:,.1f} | {dumps:,.1f} | {enc / dumps:.1f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--saves", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--wait-s", type=float, default=10.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--contend", type=int, default=0,
                    help="processes spinning on the cores during the floor and the saves")
    ap.add_argument("--lag", type=int, default=30, help="waits of the lag figure (0: skip)")
    ap.add_argument("--agent", nargs="?", const="default", choices=("default", "every"),
                    help="with the node agent: the default path on Linux (a save under "
                         "$CKPTD_AGENT_MIN_BYTES written by its rank), or every save through "
                         "the agent")
    ap.add_argument("--timeline", action="store_true",
                    help="only where a tiny save's time goes, event by event")
    ap.add_argument("--codec", type=int, nargs="?", const=2000, default=None, metavar="T",
                    help="only the decode and encode of partials: the tiny save's and one of "
                         "T small tensors a rank (2000)")
    args = ap.parse_args(argv)
    if args.codec is not None:
        _codec(args.world, args.codec, args.runs, args.dir)
        return
    if args.timeline:
        _timeline(args.world, args.saves, args.dir)
        return

    if args.lag > 0:
        with tempfile.TemporaryDirectory(prefix="ckptd-lag-", dir=args.dir) as root:
            for watched in (False, True):
                xs = _lag(root, args.lag, watched)
                print(f"learning a rename 13 ms into a wait ({args.lag} waits), "
                      f"{'with' if watched else 'without'} the storage's watch: median "
                      f"{statistics.median(xs) * 1e3:.2f} ms, max {max(xs) * 1e3:.2f} ms after "
                      "it (floor 0)")
        print()

    def row(name: str, xs: list[float], syncs: list[float], cpu: list[float]) -> str:
        xs = sorted(xs)
        fsyncs = ("not counted" if math.isnan(syncs[0])
                  else f"{syncs[0]:g} / {max(syncs[1:], default=0):g}")
        return (f"| {name} | {statistics.median(xs) * 1e3:.1f} ms | "
                f"{xs[int(0.9 * (len(xs) - 1))] * 1e3:.1f} ms | {fsyncs} | {cpu[0] * 1e3:.1f} / "
                f"{statistics.median(cpu[1:] or [0.0]) * 1e3:.1f} ms |")

    if args.wait_s > 0:
        waits = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="ckptd-wait-", dir=args.dir) as root:
                waits.append(_wait_cpu(root, args.wait_s))
        print(f"waiting for a commit ({args.wait_s:g} s, storage only): CPU per second of "
              f"waiting, median of {len(waits)}: "
              f"{statistics.median(w for w, _ in waits) * 1e3:.2f} ms/s (floor 0; runs: "
              + ", ".join(f"{w * 1e3:.2f} ms/s, {n} manifest probes" for w, n in waits)
              + ")\n")
    medians: dict[str, list[float]] = {"save": [], "floor": []}
    cpus: dict[str, list[float]] = {"save": [], "floor": []}
    probes: list[float] = []
    for run in range(args.runs):
        probes.append(_host_probe())
        with tempfile.TemporaryDirectory(prefix="ckptd-commit-", dir=args.dir) as root, \
                common.busy_processes(args.contend):
            floor = multirank.run(_floor_rank, args.world, root, args.saves, timeout=600)
            saves = multirank.run(_save_rank, args.world, os.path.join(root, "ckpt"),
                                  args.saves, args.agent, timeout=600)
        busy = f"; busy processes: {args.contend}" if args.contend else ""
        print(f"run {run + 1}: tiny save, W = {args.world} gloo ranks, {args.saves} saves"
              f"{busy}; host probe {probes[-1] * 1e3:.1f} ms\n")
        print("| | median | p90 | fsyncs per save, rank 0 / others | CPU per save, rank 0 / "
              "others |\n|---|---:|---:|---:|---:|")
        where = {None: "", "default": " (node agent running, default path)",
                 "every": " (every save through the node agent)"}[args.agent]
        print(row(f"ckptd{where}: save_async → every "
                  "rank's result()", saves[0][0],
                  [s for _, s, _ in saves], [c for _, _, c in saves]))
        print(row("floor: the fsyncs it needs, barriers for the protocol", floor[0][0],
                  [s for _, s, _ in floor], [c for _, _, c in floor]))
        for k, res in (("save", saves), ("floor", floor)):
            cpus[k].append(sum(c for _, _, c in res))
        medians["save"].append(statistics.median(saves[0][0]))
        medians["floor"].append(statistics.median(floor[0][0]))
        print(f"\nratio (median): {medians['save'][-1] / medians['floor'][-1]:.2f}× floor\n")
    save, floor_ = (statistics.median(medians[k]) for k in ("save", "floor"))
    ratios = [s / f for s, f in zip(medians["save"], medians["floor"], strict=True)]
    busy = f" ({args.contend} busy processes)" if args.contend else ""
    print(f"medians of {args.runs} runs{busy}: save {save * 1e3:.1f} ms, floor "
          f"{floor_ * 1e3:.1f} ms, ratio {statistics.median(ratios):.2f}× (the runs' own ratios: "
          + ", ".join(f"{r:.2f}" for r in ratios) + f"; ratio of the medians {save / floor_:.2f}×)"
          f"; CPU per save, all ranks: save {statistics.median(cpus['save']) * 1e3:.1f} ms, "
          f"floor {statistics.median(cpus['floor']) * 1e3:.1f} ms; host probe "
          + ", ".join(f"{p * 1e3:.1f}" for p in probes) + " ms")
    if args.agent:  # the agent outlives the runs (it exits after 600 idle s): stop it now
        from ckptd.cli import main as cli

        cli(["agent", "--stop"])


if __name__ == "__main__":
    main()
