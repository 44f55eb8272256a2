"""Load-path benchmark: ckptd loads resharding to 4, 3, 2 and 8 ranks next to the read floor
and torch.distributed.checkpoint (DCP) on the same layouts, in one run; and a checkpoint
rewritten by ``ckptd reshard`` against the original.

    python benchmarks/load.py --size 2GiB [--worlds 4,3,2,8] [--runs 1] [--json out.json]
                              [--sections gap,unit,floor,load,resharded,read_once] [--dir DIR]

The state is benchmarks/common.py's transformer training state (bf16 params, fp32 master and
Adam moments, 240 tensors), saved by 4 gloo ranks each holding 1/4 of dim 0 of every tensor
(ckptd ``Shard`` leaves; DCP ``DTensor`` ``Shard(0)`` on a 1-d mesh). A load on W ranks gives
each rank ``torch.chunk``'s share of dim 0 of every tensor (the same for both). Every load is
cold: the page cache is dropped (``/proc/sys/vm/drop_caches``, as root) before each one.

Figures per load: wall time (all ranks start after a barrier; the slowest rank's time), peak
extra RSS per rank (``VmHWM`` after the load minus ``VmRSS`` before it, reset through
``/proc/self/clear_refs``), bytes needed (the destination), bytes requested from storage
(ckptd's reader counters; ``rchar`` for DCP) and bytes read from the device (``read_bytes`` of
``/proc/self/io``). The floor is the bytes all ranks need at the cold sequential read bandwidth
measured in the same run (the ranks share one disk). Results print as a markdown table and go
to --json with every raw figure.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import multirank  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    build_state,
    default_dir,
    drop_caches,
    fmt_bytes,
    machine_info,
    parse_size,
    remove,
)

SECTIONS = ("gap", "unit", "floor", "load", "hold", "resharded", "read_once")
# "hold": keep everything read between the verify and the copy pass (1.5 GiB: every world here)
HOLD = {"load_budget_bytes": 3 << 29, "local_hold_bytes": 3 << 29}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")


# ============================================================================ saving
def _save_rank(rank: int, world: int, size: int, root: str, frame_bytes: int | None) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import ckptd
    from ckptd import config

    state = build_state(size, rank, world)
    frames = {"frame_bytes": frame_bytes} if frame_bytes else {}
    with config.override(**frames), ckptd.Checkpointer(f"{root}/ckptd") as ck:
        ck.save(state.ckptd_tree(), step=1)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(state.dcp_tree(mesh), checkpoint_id=f"{root}/dcp")
    return state.nbytes


# ============================================================================ loading
def tensor_specs(root: str) -> list[tuple[str, tuple[int, ...], str]]:
    from ckptd.manifest import decode

    with open(f"{root}/step-000000001/manifest.json", "rb") as f:
        m = decode(f.read(), root)
    return [(n, e.shape, str(e.dtype).removeprefix("torch.")) for n, e in sorted(m.tensors.items())
            if not n.startswith("__local__/")]


def _chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    c = -(-n // world)
    start = min(rank * c, n)
    return start, max(0, min(c, n - start))


def destination(specs: list[Any], rank: int, world: int, method: str, split_dim: int = 0,
                ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """This rank's share of every tensor (torch.chunk along ``split_dim``, or dim 0 of 1-d
    tensors), zero-filled (touched, so the load does not pay page faults), as a state tree."""
    import ckptd

    mesh = None
    if method == "dcp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    tree: dict[str, Any] = {"step": 0}
    locals_ = []
    for name, shape, dtype in specs:
        d = split_dim if len(shape) > split_dim else 0
        start, n = _chunk(shape[d], world, rank)
        local_shape = list(shape)
        local_shape[d] = n
        local = torch.zeros(local_shape, dtype=getattr(torch, dtype))
        locals_.append(local)
        offsets = [0] * len(shape)
        offsets[d] = start
        if method == "dcp":
            from torch.distributed.tensor import DTensor, Shard

            stride = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                stride[i] = stride[i + 1] * shape[i + 1]
            leaf: Any = DTensor.from_local(local, mesh, [Shard(d)], run_check=False,
                                           shape=torch.Size(shape), stride=tuple(stride))
        else:
            leaf = ckptd.Shard(local, shape, offsets)
        node = tree
        prefix, _, fqn = name.rpartition("/")
        for key in prefix.split("/"):
            node = node.setdefault(key, {})
        node[fqn] = leaf
    return tree, locals_


def _load_rank(rank: int, world: int, method: str, path: str, specs: list[Any], split_dim: int,
               knobs: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import ckptd
    from ckptd import config
    from ckptd.loader.load import last_stats

    torch.set_num_threads(1)
    read_once = knobs.get("read_once")
    if read_once is not None:  # read-once: every rank loads the whole model/ group (replicated)
        tree: dict[str, Any] = {"model": {}}
        locals_ = []
        for name, shape, dtype in specs:
            if name.startswith("model/"):
                t = torch.zeros(shape, dtype=getattr(torch, dtype))
                tree["model"][name.removeprefix("model/")] = t
                locals_.append(t)
    else:
        tree, locals_ = destination(specs, rank, world, method, split_dim)
    needed = sum(t.numel() * t.element_size() for t in locals_)
    ck = ckptd.Checkpointer(path) if method == "ckptd" else None  # set up once, as in training
    # a fresh process still owes the cyclic GC a full pass over torch's objects (~0.1 s, due at
    # the first allocation-heavy call, e.g. json.loads of the manifest); a training process has
    # paid it long before it loads
    gc.collect()
    dist.barrier()
    if rank == 0:
        drop_caches()
    dist.barrier()
    reset_peak_rss()
    rss0, io0 = status("VmRSS"), proc_io()
    t0 = time.perf_counter()
    stats = None
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(tree, checkpoint_id=path)
    else:
        assert ck is not None
        cfg = {k: v for k, v in knobs.items() if k == "load_budget_bytes"}
        tun = {k: v for k, v in knobs.items() if k in ("read_once", "local_hold_bytes")}
        with config.override(**tun), config.override(**cfg):
            ck.load(tree, step=1, strict=False)
        stats = last_stats()
        ck.close()
    t_local = time.perf_counter() - t0
    io1, hwm = proc_io(), status("VmHWM")
    dist.barrier()
    out: dict[str, Any] = {
        "time_s": t_local, "needed": needed, "peak_extra_rss": max(0, hwm - rss0),
        "rchar": io1["rchar"] - io0["rchar"], "device_read": io1["read_bytes"] - io0["read_bytes"],
        "digest": [float(t.double().sum()) for t in locals_],
    }
    if stats is not None:
        out.update(stored=stats.reads.stored_bytes, ranges=stats.planned_ranges,
                   first_pass=stats.reads.stored_bytes - stats.reread.stored_bytes,
                   requests=stats.reads.ranges, peak_buffer=stats.peak_buffer_bytes,
                   passes=stats.passes, ckptd_needed=stats.needed_bytes,
                   broadcast=stats.broadcast_bytes, seconds=stats.seconds)
    return out


def run_load(method: str, world: int, path: str, specs: list[Any], split_dim: int = 0,
             **knobs: Any) -> dict[str, Any]:
    for attempt in range(2):  # a run stuck past the timeout is retried once, and recorded
        try:
            per_rank = multirank.run(_load_rank, world, method, path, specs, split_dim, knobs,
                                     timeout=300)
            break
        except multirank.RankFailed as e:
            log(f"  {method} on {world} ranks failed (attempt {attempt + 1}): "
                f"{str(e).splitlines()[0]}")
            if attempt:
                raise
    return {"time_s": max(r["time_s"] for r in per_rank), "ranks": per_rank,
            "needed": sum(r["needed"] for r in per_rank),
            "stored": sum(r.get("stored", r["rchar"]) for r in per_rank),
            "first_pass": sum(r.get("first_pass", r["rchar"]) for r in per_rank),
            "device_read": sum(r["device_read"] for r in per_rank),
            "peak_extra_rss": max(r["peak_extra_rss"] for r in per_rank)}


# ============================================================================ floors
def cold_read(paths: list[str], unit: int, threads: int) -> float:
    """Seconds to read ``paths`` whole, cold, in ``unit`` requests on ``threads`` threads."""
    drop_caches()
    jobs = []
    for p in paths:
        n = os.path.getsize(p)
        jobs += [(p, off, min(unit, n - off)) for off in range(0, n, unit)]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def one(job: tuple[str, int, int]) -> int:
        buf = bytearray(job[2])
        return os.preadv(fds[job[0]], [buf], job[1])

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(one, jobs))
    dt = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    assert total == sum(os.path.getsize(p) for p in paths)
    return dt


def data_files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if n.endswith(".bin")]
    return sorted(out)


GAPS = (16 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20)


def gap_table(path: str, piece: int = 256 << 10) -> list[dict[str, Any]]:
    """Reading pieces separated by a gap, cold: one request per piece, or one covering the
    gap; each gap size on its own region of the file."""
    rows = []
    span = os.path.getsize(path) // len(GAPS)
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, gap in enumerate(GAPS):
            base = i * span
            offs = list(range(base, base + span - piece - gap, piece + gap))
            row: dict[str, Any] = {"gap": gap, "pieces": len(offs), "piece": piece}
            for mode in ("separate", "merged"):
                drop_caches()
                t = time.perf_counter()
                if mode == "separate":
                    for o in offs:
                        os.preadv(fd, [bytearray(piece)], o)
                else:
                    buf = bytearray(piece + gap)
                    for o in offs:
                        os.preadv(fd, [buf], o)
                row[mode] = time.perf_counter() - t
            rows.append(row)
    finally:
        os.close(fd)
    return rows


def unit_table(root: str, threads: tuple[int, ...] = (1, 2, 4)) -> list[dict[str, Any]]:
    """ckptd's reader (ranged reads + checksums) over one rank's files, cold, by read unit."""
    import ckptd
    from ckptd import config
    from ckptd.loader.fetch import Buffers, StepFiles, run_ranges
    from ckptd.loader.plan import coalesce
    from ckptd.loader.verify import whole_chunk_reads

    with ckptd.Checkpointer(root, read_only=True) as ck:
        storage, m = ck.storage, ck.read_manifest(1)
    itemsize = {n: e.itemsize for n, e in m.tensors.items()}
    mine = m.with_frames([(n, c) for n, e in m.tensors.items() for c in e.chunks if c.rank == 0])
    names = [n for n, e in m.tensors.items() for c in e.chunks if c.rank == 0]
    rows = []
    for unit in (1 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20):
        reads = [r for n, c in zip(names, mine, strict=True)
                 for r in whole_chunk_reads(n, c, itemsize[n], unit)]
        ranges = coalesce(reads, 256 << 10, unit)
        nbytes = sum(r.length for r in ranges)
        for t in threads:
            drop_caches()
            with ThreadPoolExecutor(t) as pool, \
                    StepFiles(storage, "step-000000001", {r.file for r in ranges}) as files:
                t0 = time.perf_counter()
                run_ranges(files, ranges, pool, Buffers(config.get().load_budget_bytes, unit))
                dt = time.perf_counter() - t0
            rows.append({"unit": unit, "threads": t, "GBps": nbytes / dt / 1e9})
    return rows


# ============================================================================ driver
def reshard(src: str, out: str, world: int, layout: str) -> float:
    remove(out)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckptd.cli", "reshard", src, "--to-world",
                    str(world), "--layout", layout, "--out", out, "--json"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("2GiB"))
    p.add_argument("--worlds", default="4,3,2,8")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--frame-bytes", type=parse_size, default=None,
                   help="ckptd frame size of the saved checkpoint (default: ckptd's)")
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    root = args.dir or default_dir()
    os.makedirs(root, exist_ok=True)
    res: dict[str, Any] = {"machine": machine_info(root), "size": args.size, "dir": root,
                           "sections": sections, "loads": {}, "frame_bytes": args.frame_bytes}
    if not res["machine"]["drop_caches"]:
        log("WARNING: cannot drop the page cache: loads are not cold")
    t_all = time.perf_counter()
    try:
        if not os.path.exists(f"{root}/ckptd/step-000000001/manifest.json"):
            log(f"saving {fmt_bytes(args.size)} on 4 ranks (ckptd and DCP) into {root}")
            res["saved_bytes"] = sum(multirank.run(_save_rank, 4, args.size, root,
                                                   args.frame_bytes, timeout=1800))
        specs = tensor_specs(f"{root}/ckptd")
        res["tensors"] = len(specs)
        files = data_files(f"{root}/ckptd")
        if "gap" in sections:
            log("gap threshold")
            res["gap"] = gap_table(files[0])
        if "unit" in sections:
            log("read unit x threads")
            res["unit"] = unit_table(f"{root}/ckptd")
        if "floor" in sections:
            log("cold sequential read floor")
            res["floor"] = {f"{t}x{u >> 20}MiB": sum(os.path.getsize(f) for f in files)
                            / cold_read(files, u, t) for t in (1, 2, 4) for u in (4 << 20, 8 << 20)}
        for run in range(args.runs):
            for world in worlds if "load" in sections else []:
                for method in ("ckptd", "dcp", "ckptd-hold"):
                    if method == "ckptd-hold" and "hold" not in sections:
                        continue
                    log(f"load on {world} ranks: {method} (run {run + 1})")
                    knobs = HOLD if method == "ckptd-hold" else {}
                    r = run_load(method.split("-")[0], world, f"{root}/{method.split('-')[0]}",
                                 specs, **knobs)
                    res["loads"].setdefault(f"{method}/{world}", []).append(r)
        if "resharded" in sections:
            lay = f"{root}/layout.toml"
            with open(lay, "w") as f:  # every tensor: dim 0 split over the ranks (torch.chunk)
                f.write("[[rule]]\nmatch = '*'\ndp_dim = 0\n")
            res["reshard_s"] = reshard(f"{root}/ckptd", f"{root}/resharded3", 3, lay)
            for run in range(args.runs):
                for name, path in (("original", f"{root}/ckptd"),
                                   ("resharded", f"{root}/resharded3")):
                    log(f"load on 3 ranks: {name} (run {run + 1})")
                    res["loads"].setdefault(f"{name}/3", []).append(
                        run_load("ckptd", 3, path, specs))
            res["reshard_dim1_s"] = reshard_dim1(root, specs)
            for run in range(args.runs):
                for name, path in (("original-dim1", f"{root}/ckptd"),
                                   ("resharded-dim1", f"{root}/resharded3-dim1")):
                    log(f"load on 3 ranks, dim 1 split: {name} (run {run + 1})")
                    res["loads"].setdefault(f"{name}/3", []).append(
                        run_load("ckptd", 3, path, specs, split_dim=1))
        for _ in range(args.runs if "read_once" in sections else 0):
            for mode in ("off", "on"):
                log(f"4 ranks load the whole model/ group, read-once {mode}")
                res["loads"].setdefault(f"read_once_{mode}/4", []).append(
                    run_load("ckptd", 4, f"{root}/ckptd", specs, read_once=mode))
    finally:
        res["total_s"] = time.perf_counter() - t_all
        res["loadavg_at_end"] = os.getloadavg()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        if not args.keep and not args.dir:
            remove(root)
    print(report(res))


def reshard_dim1(root: str, specs: list[Any]) -> float:
    """The checkpoint rewritten for 3 ranks holding dim 1 of 2-d tensors (dim 0 of 1-d)."""
    lay = f"{root}/layout-dim1.json"
    two_d = sorted(n for n, s, _ in specs if len(s) == 2)
    with open(lay, "w") as f:
        json.dump({"rule": [{"match": two_d, "dp_dim": 1}, {"match": "*", "dp_dim": 0}]}, f)
    return reshard(f"{root}/ckptd", f"{root}/resharded3-dim1", 3, lay)


# ============================================================================ report
def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run (the box is shared: slower runs measure the neighbours)."""
    return min(runs, key=lambda r: float(r["time_s"]))


def _profile(run: dict[str, Any]) -> str:
    """Per-phase seconds of the slowest rank."""
    slow = max(run["ranks"], key=lambda r: r["time_s"])
    phases = slow.get("seconds", {})
    other = slow["time_s"] - sum(phases.values())  # Checkpointer.load around load_into
    return " ".join(f"{k} {v:.2f}" for k, v in phases.items() if v >= 0.005) + \
        f" other (manifest, describe) {other:.2f}"


def report(res: dict[str, Any]) -> str:
    out = io.StringIO()
    m = res["machine"]
    out.write(f"machine: {m['cpu']} x{m['nproc']}, torch {m['torch']}, python {m['python']}; "
              f"loadavg start {m['loadavg_at_start']} end {res.get('loadavg_at_end')}; "
              f"page cache dropped before each load: {m['drop_caches']}\n")
    out.write(f"state: {fmt_bytes(res.get('saved_bytes', res['size']))} in "
              f"{res.get('tensors')} tensors, saved by 4 ranks; total run "
              f"{res['total_s']:.0f} s\n\n")
    floor_bw = max(res.get("floor", {}).values(), default=float("nan"))
    if "floor" in res:
        out.write("cold sequential read bandwidth (threads x request): " + ", ".join(
            f"{k} {v / 1e9:.2f} GB/s" for k, v in res["floor"].items()) + "\n\n")
    loads = res["loads"]
    out.write("| load | ranks | time s | floor s | floor/time | vs DCP | bytes needed | "
              "read/needed (verify pass) | all passes/needed | device/needed | "
              "peak extra RSS/rank | ranges/rank |\n")
    out.write("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    profiles = []
    for key, runs in loads.items():
        method, world = key.split("/")
        b = _best(runs)
        t, needed = b["time_s"], b["needed"]
        floor = needed / floor_bw
        dcp = loads.get(f"dcp/{world}") if method.startswith("ckptd") else None
        vs = f"{_best(dcp)['time_s'] / t:.2f}x" if dcp else ""
        ranges = [r.get("ranges") for r in b["ranks"]]
        out.write(f"| {method} | {world} | {t:.2f} | {floor:.2f} | {floor / t:.2f} | {vs} | "
                  f"{fmt_bytes(needed)} | {b.get('first_pass', b['stored']) / needed:.3f} | "
                  f"{b['stored'] / needed:.3f} | "
                  f"{b['device_read'] / needed:.3f} | {fmt_bytes(b['peak_extra_rss'])} | "
                  f"{'' if None in ranges else max(ranges)} |\n")
        if method != "dcp":
            profiles.append(f"{key}: {_profile(b)}")
    out.write("\nprofile (seconds per phase, slowest rank):\n\n" + "".join(
        f"- {p}\n" for p in profiles))
    checks = []
    for key, runs in loads.items():
        method, world = key.split("/")
        ref = loads.get(f"dcp/{world}") if method == "ckptd" else None
        if method in ("resharded", "original") and loads.get("original/3"):
            ref = loads["original/3"]
        if method == "resharded-dim1" and loads.get("original-dim1/3"):
            ref = loads["original-dim1/3"]
        if ref:
            same = [a["digest"] == b["digest"] for a, b in zip(runs[0]["ranks"], ref[0]["ranks"],
                                                                strict=True)]
            checks.append(f"{key}: {'same values' if all(same) else 'VALUES DIFFER'}")
    out.write("\ncorrectness (per-tensor sums of every rank vs the reference load): "
              + "; ".join(checks) + "\n")
    if "reshard_s" in res:
        out.write(f"\n`ckptd reshard --to-world 3`: {res['reshard_s']:.1f} s (dim 1: "
                  f"{res.get('reshard_dim1_s', float('nan')):.1f} s)\n")
    for k in ("gap", "unit"):
        if k in res:
            out.write(f"\n{k}: {json.dumps(res[k])}\n")
    return out.getvalue()


if __name__ == "__main__":
    main()
