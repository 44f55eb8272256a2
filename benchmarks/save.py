"""Save-path benchmark: ckptd.save_async next to its floors, torch.save and
torch.distributed.checkpoint (DCP) on the same state, in one run.

    python benchmarks/save.py --size 2GiB [--ranks 1|4] [--runs 3] [--json out.json] [--dir DIR]

The state is a transformer-shaped training state (bf16 parameters + fp32 master weights and Adam
moments, 8 layers, ~240 tensors from 1 KiB norms to 100+ MiB embeddings) scaled to --size bytes
in total; with --ranks N every rank holds 1/N of it (dim 0 of every tensor split): ckptd.Shard
leaves for ckptd, DTensors (Shard(0) on a 1-d CPU mesh) for DCP, plain local tensors for
torch.save. Every figure is the median of --runs timed runs after one warm-up run; every fresh
save goes to a new directory, deleted (outside the timing) before the next run.

Prints one markdown table (and writes it as JSON with every run's raw figures). See
benchmarks/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import (  # noqa: E402
    ALIGN,
    Compute,
    State,
    aligned_empty,
    build_state,
    default_dir,
    drop_caches,
    fmt_bytes,
    fsync_dir,
    fsync_tree,
    gbps,
    machine_info,
    median,
    parse_size,
    remove,
    spread,
    torch_threads,
    write_fsync,
    write_fsync_parallel,
)

SECTIONS = ("floors", "torch", "dcp", "ckptd", "interference")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ============================================================================ one rank's suite


class Rank:
    """Runs every measurement on one rank, in lockstep with the other ranks (barriers)."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any], root: str) -> None:
        self.rank, self.world, self.cfg, self.root = rank, world, cfg, root
        self.runs: dict[str, list[float]] = {}
        self.info: dict[str, Any] = {}
        self.notes: list[str] = []
        self.pg = self.dcp_pg = self.mesh = None
        if world > 1:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            # DCP's async upload runs collectives from a background thread: give it its own
            # group so it never interleaves with the barriers of this (main) thread.
            self.dcp_pg = dist.new_group(backend="gloo")
            self.mesh = init_device_mesh("cpu", (world,))
        t = time.perf_counter()
        self.state: State = build_state(cfg["size"], rank, world)
        self.nbytes = self.state.nbytes
        self.info.update(
            nbytes=self.nbytes,
            ntensors=self.state.ntensors,
            shape=vars(self.state.shape),
            build_s=time.perf_counter() - t,
        )
        self.compute = Compute(threads=cfg["compute_threads"])

    # -- plumbing
    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def add(self, key: str, value: float) -> None:
        self.runs.setdefault(key, []).append(float(value))

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def shared_cleanup(self, path: str) -> None:
        """After every rank is done with ``path``, rank 0 deletes it."""
        self.barrier()
        if self.rank == 0:
            remove(path)
            os.sync()
        self.barrier()

    def repeat(self, fn: Callable[[int, bool], None], runs: int | None = None) -> None:
        """Warm-up run(s) then --runs timed runs; ``fn(i, timed)``."""
        warm, runs = self.cfg["warmup"], runs or self.cfg["runs"]
        for i in range(warm + runs):
            self.barrier()
            if self.cfg["drop_caches"] and self.rank == 0:
                drop_caches()
            self.barrier()
            fn(i, i >= warm)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            log(msg)

    # -- sections
    def run(self) -> dict[str, Any]:
        wanted = self.cfg["sections"]
        for name in SECTIONS:
            if name in wanted:
                t = time.perf_counter()
                self.log(f"{name} ...")
                getattr(self, f"section_{name}")()
                self.info[f"section_{name}_s"] = time.perf_counter() - t
                self.log(f"{name} done in {time.perf_counter() - t:.1f} s")
        return {"rank": self.rank, "runs": self.runs, "info": self.info, "notes": self.notes}

    def section_floors(self) -> None:
        st = self.state
        # "the same bytes", laid out like a staging arena (padded to 4 KiB for O_DIRECT)
        image = aligned_empty(_round_up(self.nbytes, ALIGN))
        dst = aligned_empty(image.numel())
        offsets, off = [], 0
        for lf in st.leaves:
            offsets.append(off)
            off = -(-(off + lf.local.numel() * lf.local.element_size()) // 64) * 64
        mem = memoryview(image.numpy()).cast("B")
        k = _io_threads()
        self.info["io_threads"] = k
        direct_ok = True

        def copy_per_tensor() -> None:
            for lf, o in zip(st.leaves, offsets, strict=True):
                n = lf.local.numel() * lf.local.element_size()
                image[o : o + n].view(lf.local.dtype).view(lf.local.shape).copy_(lf.local)

        nt = torch.get_num_threads()
        copies = [("", None)] if nt == 1 else [(f".t{nt}", None), (".t1", 1)]

        def once(i: int, timed: bool) -> None:
            nonlocal direct_ok
            for suffix, threads in copies:
                with torch_threads(threads):
                    self.barrier()
                    t = time.perf_counter()
                    copy_per_tensor()
                    t_copy = time.perf_counter() - t
                    self.barrier()
                    t = time.perf_counter()
                    dst.copy_(image)
                    t_memcpy = time.perf_counter() - t
                if timed:
                    self.add("floor.copy_per_tensor" + suffix, t_copy)
                    self.add("floor.memcpy" + suffix, t_memcpy)
            for key, direct, files in (
                ("floor.write_buffered", False, 1),
                ("floor.write_direct", True, 1),
                (f"floor.write_direct_x{k}", True, k),
                (f"floor.write_buffered_x{k}", False, k),
            ):
                if direct and not direct_ok:
                    continue
                paths = [self.path(f"floor-r{self.rank}-{i}-{j}.bin") for j in range(files)]
                self.barrier()
                try:
                    dt = (
                        write_fsync(paths[0], mem, direct)
                        if files == 1
                        else write_fsync_parallel(paths, mem, direct)
                    )
                    if dt is not None:
                        fsync_dir(self.root)
                finally:
                    for p in paths:
                        remove(p)
                if dt is None:
                    direct_ok = False
                    self.notes.append(
                        f"rank {self.rank}: the filesystem of {self.root} refuses "
                        "O_DIRECT (EINVAL): no O_DIRECT floor"
                    )
                    continue
                if timed:
                    self.add(key, dt)
            os.sync()

        self.repeat(once)

    def section_torch(self) -> None:
        tree = self.state.plain()

        def once(i: int, timed: bool) -> None:
            path = self.path(f"torch-save-r{self.rank}-{i}.pt")
            t = time.perf_counter()
            torch.save(tree, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            fsync_dir(self.root)
            dt = time.perf_counter() - t
            remove(path)
            os.sync()
            if timed:
                self.add("torch.save", dt)

        self.repeat(once)

    def _dcp_tree(self) -> dict[str, Any]:
        return self.state.dcp_tree(self.mesh)

    def section_dcp(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        tree = self._dcp_tree()

        def sync_once(i: int, timed: bool) -> None:
            d = self.path(f"dcp-save-{i}")
            t = time.perf_counter()
            dcp.save(tree, checkpoint_id=d, process_group=self.dcp_pg)
            fsync_tree(d)
            dt = time.perf_counter() - t
            self.shared_cleanup(d)
            if timed:
                self.add("dcp.save", dt)

        self.repeat(sync_once)

        variants: list[tuple[str, Callable[[], Any] | None]] = [("dcp.async.default", None)]
        variants.append(
            (
                "dcp.async.reused_sync",
                lambda: DefaultStager(StagingOptions(False, False, False, False)),
            )
        )
        variants.append(
            (
                "dcp.async.reused_async",
                lambda: DefaultStager(StagingOptions(False, False, True, False)),
            )
        )
        for key, make in variants:
            stager = make() if make else None
            self.log(f"  {key}")
            self.repeat(
                lambda i, timed, key=key, stager=stager: self._dcp_async_once(
                    key, tree, stager, i, timed
                )
            )
            if stager is not None:
                stager.close()

    def _dcp_async_once(self, key: str, tree: Any, stager: Any, i: int, timed: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        d = self.path(f"{key}-{i}")
        t0 = time.perf_counter()
        resp = dcp.async_save(tree, checkpoint_id=d, process_group=self.dcp_pg, async_stager=stager)
        t_call = time.perf_counter() - t0
        if isinstance(resp, AsyncSaveResponse):
            resp.staging_completion.result()
            t_staged = time.perf_counter() - t0
            fut = resp.upload_completion
        else:
            t_staged, fut = t_call, resp
        fut.result()
        fsync_tree(d)  # DCP fsyncs its files (sync_files=True) but not the directories
        t_durable = time.perf_counter() - t0
        self.shared_cleanup(d)
        if timed:
            self.add(f"{key}.call", t_call)
            self.add(f"{key}.staged", t_staged)
            self.add(f"{key}.durable", t_durable)

    def section_ckptd(self) -> None:
        tree = self.state.ckptd_tree()
        variants: list[tuple[str, str | None, bool, int | None]] = [
            ("ckptd", None, False, None),
            ("ckptd.zstd", "zstd", False, None),
            ("ckptd.overlap", None, True, None),
        ]
        if torch.get_num_threads() > 1:  # diagnosis: the same save with 1 intra-op thread
            variants.append(("ckptd.t1", None, False, 1))
        for key, compression, overlap, threads in variants:
            self.log(f"  {key}")
            ck = self._checkpointer(key, compression)
            with torch_threads(threads):
                self.repeat(
                    lambda i, timed, key=key, ck=ck, overlap=overlap: self._ckptd_once(
                        key, ck, tree, overlap, i, timed
                    )
                )
            ck.close()
            del ck
            self.shared_cleanup(self.path(key))

    def _checkpointer(self, key: str, compression: str | None) -> Any:
        import ckptd

        # keep_last=0: no retention inside the timed save (the benchmark deletes old steps
        # itself, outside the timing; see the README for what retention costs)
        return ckptd.Checkpointer(
            self.path(key),
            rank=self.rank,
            world_size=self.world,
            keep_last=0,
            compression=compression,
            run_id="bench-" + key,
        )

    def _ckptd_once(self, key: str, ck: Any, tree: Any, overlap: bool, i: int, timed: bool) -> None:
        wall0 = time.time()
        t0 = time.perf_counter()
        h = ck.save_async(tree, step=i, overlap=overlap)
        t_call = time.perf_counter() - t0
        if overlap:
            h.wait_staged()
        t_staged = time.perf_counter() - t0
        r = h.result()
        # absolute times, to line ranks up (commit latency of non-coordinators) in the JSON
        self.info.setdefault(f"{key}.wall", []).append(
            {
                "run": i,
                "start": wall0,
                "staged": wall0 + t_staged,
                "committed": wall0 + time.perf_counter() - t0,
            }
        )
        step_dir = os.path.join(self.path(key), f"step-{i:09d}")
        fsync_tree(step_dir)  # ckptd fsyncs data files and manifests; + the data directories
        t_durable = time.perf_counter() - t0
        if i == 0:
            self.info[f"{key}.first_stall"] = h.stall_s
            self.info[f"{key}.first_call"] = t_call
            self.info[f"{key}.first_durable"] = t_durable
        if timed:
            self.add(f"{key}.stall_s", h.stall_s)
            self.add(f"{key}.call", t_call)
            self.add(f"{key}.staged", t_staged)
            self.add(f"{key}.durable", t_durable)
            self.add(f"{key}.write_s", r.write_s)
            self.add(f"{key}.stored", r.nbytes)
        self.shared_cleanup(step_dir)

    def _interference_floor(self, measure: Callable[..., None], k: int, runs: int) -> None:
        image = aligned_empty(_round_up(self.nbytes, ALIGN))
        mem = memoryview(image.numpy()).cast("B")

        def start_floor(i: int) -> tuple[Callable[[], bool], Callable[[], None], str]:
            d = self.path(f"floor.interference-{self.rank}-{i}")
            os.makedirs(d, exist_ok=True)
            th = threading.Thread(
                target=write_fsync_parallel,
                args=([os.path.join(d, f"{j}.bin") for j in range(k)], mem, True),
            )
            th.start()
            return (lambda: not th.is_alive()), th.join, d

        self.repeat(lambda i, timed: measure("interf.floor", start_floor, i, timed), runs)

    def section_interference(self) -> None:
        import torch.distributed.checkpoint as dcp

        alone_s = self.cfg["alone_s"]
        self.compute.rate_for(0.3)  # warm
        ck = self._checkpointer("ckptd.interference", None)
        ck_tree, dcp_tree = self.state.ckptd_tree(), self._dcp_tree()

        def measure(
            key: str,
            start: Callable[[int], tuple[Callable[[], bool], Callable[[], None], str]],
            i: int,
            timed: bool,
        ) -> None:
            before = self.compute.rate_for(alone_s)
            t0 = time.perf_counter()
            done, finish, d = start(i)
            t_call = time.perf_counter() - t0
            rate, window, _ = self.compute.rate_until(done)
            finish()
            t_durable = time.perf_counter() - t0
            after = self.compute.rate_for(alone_s)
            self.shared_cleanup(d)
            if timed:
                alone = (before + after) / 2
                self.add(f"{key}.alone_rate", alone)
                self.add(f"{key}.during_rate", rate)
                self.add(f"{key}.slowdown", alone / rate)
                self.add(f"{key}.window", window)
                self.add(f"{key}.call", t_call)
                self.add(f"{key}.durable", t_durable)

        def start_ckptd(i: int) -> tuple[Callable[[], bool], Callable[[], None], str]:
            h = ck.save_async(ck_tree, step=i)
            step_dir = os.path.join(self.path("ckptd.interference"), f"step-{i:09d}")

            def finish() -> None:
                h.result()
                fsync_tree(step_dir)

            return h.done, finish, step_dir

        def start_dcp(i: int) -> tuple[Callable[[], bool], Callable[[], None], str]:
            d = self.path(f"dcp.interference-{i}")
            # default stager, synchronous staging: a plain Future (no AsyncSaveResponse)
            fut: Any = dcp.async_save(dcp_tree, checkpoint_id=d, process_group=self.dcp_pg)

            def finish() -> None:
                fut.result()
                fsync_tree(d)

            return fut.done, finish, d

        k = _io_threads()
        runs = max(self.cfg["runs"], self.cfg["interference_runs"])
        self.log(f"  O_DIRECT floor write ({k} files in {k} threads)")
        self._interference_floor(measure, k, runs)
        self.log("  ckptd")
        self.repeat(lambda i, timed: measure("interf.ckptd", start_ckptd, i, timed), runs)
        ck.close()
        self.shared_cleanup(self.path("ckptd.interference"))
        self.log("  dcp async_save (default)")
        self.repeat(lambda i, timed: measure("interf.dcp", start_dcp, i, timed), runs)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _io_threads() -> int:
    """ckptd's default number of io threads (files written in parallel per rank)."""
    try:
        from ckptd import config

        return int(config.io_threads())
    except (ImportError, AttributeError):
        return max(1, min(4, os.cpu_count() or 1))


# ============================================================================ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], root: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("ckptd").setLevel(logging.WARNING)
    try:
        if world > 1:
            import torch.distributed as dist

            # one intra-op thread per rank, as torchrun sets OMP_NUM_THREADS=1 for several
            # processes per node
            torch.set_num_threads(1)
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
            )
        result = Rank(rank, world, cfg, root).run()
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        result = {"rank": rank, "error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)


def run_ranks(world: int, cfg: dict[str, Any], root: str) -> list[dict[str, Any]]:
    outs = [os.path.join(root, f".result-{r}.json") for r in range(world)]
    if world == 1:
        _rank_main(0, 1, 0, cfg, root, outs[0])
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, cfg, root, outs[r]))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + cfg["timeout_s"]
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                raise SystemExit(f"rank {r} did not finish within {cfg['timeout_s']:.0f} s")
    results = []
    for r, path in enumerate(outs):
        try:
            with open(path) as f:
                results.append(json.load(f))
        except FileNotFoundError:
            raise SystemExit(f"rank {r} died without a result") from None
        os.unlink(path)
    errors = [res for res in results if "error" in res]
    if errors:
        raise SystemExit("\n".join(f"rank {e['rank']} failed:\n{e['error']}" for e in errors))
    return results


# ============================================================================ report


class Report:
    def __init__(self, results: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
        self.results, self.cfg = results, cfg
        self.world = len(results)
        self.nbytes = sum(r["info"]["nbytes"] for r in results)
        self.rows: list[dict[str, Any]] = []
        self.targets: list[dict[str, Any]] = []

    def per_rank(self, key: str) -> list[float]:
        return [median(r["runs"].get(key, [])) for r in self.results]

    def has(self, key: str) -> bool:
        return all(key in r["runs"] for r in self.results)

    def T(self, key: str) -> float:
        """The job's figure: the slowest rank's median for times; for compute rates the sum
        over ranks; for slowdowns the median over runs of Σ alone rate ÷ Σ rate during (ranks
        run in lockstep, so run i of every rank overlaps)."""
        if not self.has(key):
            return float("nan")
        if key.endswith("_rate"):
            return sum(self.per_rank(key))
        if key.endswith(".slowdown") and self.world > 1:
            prefix = key[: -len(".slowdown")]
            alone = [r["runs"][f"{prefix}.alone_rate"] for r in self.results]
            during = [r["runs"][f"{prefix}.during_rate"] for r in self.results]
            n = min(len(x) for x in alone + during)
            return median([sum(a[i] for a in alone) / sum(d[i] for d in during) for i in range(n)])
        return max(self.per_rank(key))

    def spread(self, key: str) -> float:
        return max(spread(r["runs"].get(key, [])) for r in self.results)

    def row(
        self,
        section: str,
        label: str,
        key: str | None,
        value: float | None = None,
        unit: str = "s",
        gbps_of: int | None = None,
        vs_floor: str = "",
        vs_dcp: str = "",
        target: str = "",
        note: str = "",
    ) -> None:
        if key is not None and not self.has(key):
            return
        v = self.T(key) if value is None and key is not None else value
        self.rows.append(
            {
                "section": section,
                "measure": label,
                "key": key,
                "value": v,
                "unit": unit,
                "GBps": gbps(gbps_of, v) if gbps_of and v is not None and v == v else None,
                "vs_floor": vs_floor,
                "vs_dcp": vs_dcp,
                "target": target,
                "note": note,
                "spread": self.spread(key) if key else None,
                "per_rank": self.per_rank(key) if key and self.world > 1 else None,
            }
        )

    def check(self, name: str, ok: bool, detail: str) -> str:
        if "nan" in detail:  # the reference (a floor, DCP) was not measured in this run
            return f"n/a: {name} (reference not measured)"
        self.targets.append({"target": name, "met": ok, "detail": detail})
        return f"{'✅' if ok else '❌'} {detail}"

    def build(self) -> None:
        B = self.nbytes
        T = self.T
        k = self.results[0]["info"].get("io_threads", 2)
        memcpys = {
            x: T(x)
            for x in ("floor.memcpy", *(f"floor.memcpy.t{n}" for n in (1, 2, 4, 8)))
            if self.has(x)
        }
        memcpy_key = min(memcpys, key=lambda x: memcpys[x]) if memcpys else "floor.memcpy"
        memcpy = memcpys.get(memcpy_key, float("nan"))
        writes = {
            key: T(key)
            for key in (
                "floor.write_buffered",
                "floor.write_direct",
                f"floor.write_direct_x{k}",
                f"floor.write_buffered_x{k}",
            )
            if self.has(key)
        }
        best_key = min(writes, key=lambda x: writes[x]) if writes else None
        best = writes[best_key] if best_key else float("nan")
        async_keys = [
            x
            for x in ("dcp.async.default", "dcp.async.reused_sync", "dcp.async.reused_async")
            if self.has(f"{x}.durable")
        ]
        dcp_staged_key = min(async_keys, key=lambda x: T(f"{x}.staged"), default=None)
        dcp_durable_key = min(async_keys, key=lambda x: T(f"{x}.durable"), default=None)
        dcp_staged = T(f"{dcp_staged_key}.staged") if dcp_staged_key else float("nan")
        dcp_durable = T(f"{dcp_durable_key}.durable") if dcp_durable_key else float("nan")

        def xm(v: float) -> str:
            return f"{v / memcpy:.2f}× memcpy" if memcpy == memcpy else ""

        def xw(v: float) -> str:  # throughput fraction of the best write floor
            return f"{best / v:.2f}× best write GB/s" if best == best else ""

        def xds(v: float) -> str:
            return f"{v / dcp_staged:.2f}× DCP staged" if dcp_staged == dcp_staged else ""

        def xdd(v: float) -> str:
            return f"{dcp_durable / v:.2f}× DCP GB/s" if dcp_durable == dcp_durable else ""

        def stall_row(section: str, label: str, key: str, **kw: Any) -> None:
            """A time the caller waits: against memcpy and DCP's staging."""
            self.row(section, label, key, vs_floor=xm(T(key)), vs_dcp=xds(T(key)), **kw)

        def durable_row(section: str, label: str, key: str, **kw: Any) -> None:
            """A time to durable: throughput against the write floor and DCP's."""
            self.row(section, label, key, gbps_of=B, vs_floor=xw(T(key)), vs_dcp=xdd(T(key)),
                     **kw)

        s = "floor"
        for suffix in ("", *(f".t{n}" for n in (8, 4, 2, 1))):
            threads = f", torch threads={suffix[2:]}" if suffix else ""
            key = f"floor.memcpy{suffix}"
            self.row(
                s,
                f"memcpy into a preallocated buffer (one copy_ of the whole state"
                f"{threads})" + (" ← memcpy floor" if key == memcpy_key else ""),
                key,
                gbps_of=B,
                vs_floor=xm(T(key)) if key != memcpy_key else "",
            )
            key = f"floor.copy_per_tensor{suffix}"
            self.row(
                s,
                f"copy per tensor into a preallocated arena{threads}",
                key,
                gbps_of=B,
                vs_floor=xm(T(key)),
            )
        for key, label in (
            ("floor.write_buffered", "write + fsync, buffered, 1 file"),
            ("floor.write_direct", "write + fsync, O_DIRECT, 1 file"),
            (f"floor.write_direct_x{k}", f"write + fsync, O_DIRECT, {k} files in {k} threads"),
            (f"floor.write_buffered_x{k}", f"write + fsync, buffered, {k} files in {k} threads"),
        ):
            self.row(
                s,
                label + (" ← best write floor" if key == best_key else ""),
                key,
                gbps_of=B,
                vs_floor=xw(T(key)),
            )

        s = "baseline"
        self.row(s, "torch.save + fsync", "torch.save", gbps_of=B, vs_floor=xw(T("torch.save")))
        self.row(
            s,
            "DCP save (blocking)",
            "dcp.save",
            gbps_of=B,
            vs_floor=xw(T("dcp.save")),
            vs_dcp=xdd(T("dcp.save")),
        )
        names = {
            "dcp.async.default": "DCP async_save, default stager (fresh buffers)",
            "dcp.async.reused_sync": "DCP async_save, reused DefaultStager (sync staging)",
            "dcp.async.reused_async": "DCP async_save, reused DefaultStager (use_async_staging)",
        }
        for x in async_keys:
            self.row(s, f"{names[x]}: call blocks", f"{x}.call", vs_floor=xm(T(f"{x}.call")))
            self.row(
                s,
                f"{names[x]}: until state may be modified",
                f"{x}.staged",
                vs_floor=xm(T(f"{x}.staged")),
                note="← DCP staged (best)" if x == dcp_staged_key else "",
            )
            self.row(
                s,
                f"{names[x]}: durable",
                f"{x}.durable",
                gbps_of=B,
                vs_floor=xw(T(f"{x}.durable")),
                note="← DCP durable (best)" if x == dcp_durable_key else "",
            )

        s = "ckptd"
        first = [r["info"].get("ckptd.first_stall") for r in self.results]
        if all(f is not None for f in first):
            self.rows.append(
                {
                    "section": s,
                    "measure": "save_async first save: stall_s "
                    "(allocates the arena; warm-up, not in the medians)",
                    "key": "ckptd.first_stall",
                    "value": max(first),
                    "unit": "s",
                    "GBps": gbps(B, max(first)),
                    "vs_floor": xm(max(first)),
                    "vs_dcp": xds(max(first)),
                    "target": "",
                    "note": "",
                    "spread": None,
                    "per_rank": first if self.world > 1 else None,
                }
            )
        if self.has("ckptd.stall_s"):
            st = T("ckptd.stall_s")
            tgt = self.check(
                "stall ≤ 1.25× memcpy", st <= 1.25 * memcpy, f"≤1.25× memcpy: {st / memcpy:.2f}×"
            )
            tgt += "; " + self.check(
                "stall ≤ DCP staged", st <= dcp_staged, f"≤ DCP staged: {st / dcp_staged:.2f}×"
            )
            self.row(
                s,
                "save_async: stall (handle.stall_s)",
                "ckptd.stall_s",
                gbps_of=B,
                vs_floor=xm(st),
                vs_dcp=xds(st),
                target=tgt,
            )
            stall_row(s, "save_async: call wall clock", "ckptd.call")
            du = T("ckptd.durable")
            tgt = self.check(
                "durable ≥ 0.85× best write floor",
                best / du >= 0.85,
                f"≥0.85× floor: {best / du:.2f}×",
            )
            tgt += "; " + self.check(
                "durable ≥ 1.5× DCP async_save",
                dcp_durable / du >= 1.5,
                f"≥1.5× DCP: {dcp_durable / du:.2f}×",
            )
            self.row(
                s,
                "save_async → durable (result() + dir fsync)",
                "ckptd.durable",
                gbps_of=B,
                vs_floor=xw(du),
                vs_dcp=xdd(du),
                target=tgt,
            )
            self.row(
                s,
                "background part: staged → committed (SaveResult.write_s)",
                "ckptd.write_s",
                gbps_of=B,
                vs_floor=xw(T("ckptd.write_s")),
            )
        if self.has("ckptd.t1.stall_s"):
            t1 = "diagnosis: same save, caller's torch threads=1"
            stall_row(s, f"{t1}: stall", "ckptd.t1.stall_s", gbps_of=B)
            durable_row(s, f"{t1}: durable", "ckptd.t1.durable")
        if self.has("ckptd.zstd.stall_s"):
            stall_row(s, "zstd: stall", "ckptd.zstd.stall_s")
            durable_row(s, "zstd: durable", "ckptd.zstd.durable")
            stored = sum(median(r["runs"]["ckptd.zstd.stored"]) for r in self.results)
            self.rows.append(
                {
                    "section": s,
                    "measure": "zstd: size ratio (raw / stored)",
                    "key": "ckptd.zstd.stored",
                    "value": B / stored,
                    "unit": "×",
                    "GBps": None,
                    "vs_floor": "",
                    "vs_dcp": "",
                    "target": "",
                    "note": f"{fmt_bytes(stored)} stored",
                    "spread": None,
                    "per_rank": None,
                }
            )
        if self.has("ckptd.overlap.call"):
            stall_row(s, "overlap=True: save_async returns", "ckptd.overlap.call")
            stall_row(s, "overlap=True: wait_staged() returns", "ckptd.overlap.staged")
            durable_row(s, "overlap=True: durable", "ckptd.overlap.durable")

        s = "interference"
        ct = self.cfg["compute_threads"]
        what = f"512×512 fp32 matmul + 8 tiny ops, torch threads={ct}"
        if self.has("interf.floor.slowdown"):
            self.row(s, f"compute alone, it/s ({what})", "interf.floor.alone_rate", unit="it/s")
            self.row(
                s,
                f"floor: slowdown during a bare O_DIRECT write of the same bytes ({k} "
                f"files, {k} threads)",
                "interf.floor.slowdown",
                unit="×",
            )
        if self.has("interf.ckptd.alone_rate"):
            sd = T("interf.ckptd.slowdown")
            self.row(
                s,
                "compute during ckptd's background write, it/s",
                "interf.ckptd.during_rate",
                unit="it/s",
            )
            self.row(
                s,
                "slowdown during ckptd's background write",
                "interf.ckptd.slowdown",
                unit="×",
                vs_dcp=(
                    f"{sd / T('interf.dcp.slowdown'):.2f}× DCP's slowdown"
                    if self.has("interf.dcp.slowdown")
                    else ""
                ),
                target=self.check("compute ≤ 1.3× slower", sd <= 1.3, f"≤1.3×: {sd:.2f}×"),
            )
            self.row(
                s,
                "ckptd durable while computing",
                "interf.ckptd.durable",
                gbps_of=B,
                vs_floor=xw(T("interf.ckptd.durable")),
            )
        if self.has("interf.dcp.slowdown"):
            self.row(
                s,
                "compute during DCP async_save's background write, it/s",
                "interf.dcp.during_rate",
                unit="it/s",
            )
            self.row(
                s,
                "slowdown during DCP async_save's background write",
                "interf.dcp.slowdown",
                unit="×",
            )
            self.row(
                s,
                "DCP async_save durable while computing",
                "interf.dcp.durable",
                gbps_of=B,
                vs_floor=xw(T("interf.dcp.durable")),
            )

    def markdown(self) -> str:
        multi = self.world > 1
        head = ["#", "measure", "median", "GB/s", "vs floor", "vs DCP", "target", "spread"] + (
            ["per-rank medians"] if multi else []
        )
        lines = [
            "| " + " | ".join(head) + " |",
            "|"
            + "|".join("---:" if h in ("#", "median", "GB/s", "spread") else "---" for h in head)
            + "|",
        ]
        for i, r in enumerate(self.rows, 1):
            v = r["value"]
            if r["unit"] == "s":
                val = f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"
            elif r["unit"] == "×":
                val = f"{v:.2f}×"
            else:
                val = f"{v:.1f} {r['unit']}"
            cells = [
                str(i),
                f"{r['section']}: {r['measure']}" + (f" {r['note']}" if r["note"] else ""),
                val,
                f"{r['GBps']:.2f}" if r["GBps"] else "",
                r["vs_floor"],
                r["vs_dcp"],
                r["target"],
                f"{r['spread'] * 100:.0f}%" if r["spread"] else "",
            ]
            if multi:
                pr = r["per_rank"]
                if pr is None:
                    cells.append("")
                elif r["unit"] == "s":
                    cells.append(" / ".join(f"{x * 1e3:.0f}" for x in pr) + " ms")
                else:
                    cells.append(" / ".join(f"{x:.2f}" for x in pr))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GiB", help="total state size, all ranks (default 2GiB)")
    ap.add_argument("--ranks", type=int, default=1, help="gloo processes on 127.0.0.1 (1 or 4)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per figure, after 1 warm-up")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up runs per figure (default 1)")
    ap.add_argument("--json", help="also write every figure (and every run) here")
    ap.add_argument(
        "--dir",
        help="where checkpoints go (default: a fresh directory on the "
        "writable non-tmpfs filesystem with the most free space); deleted at the end "
        "if created here",
    )
    ap.add_argument(
        "--compute-threads",
        type=int,
        default=1,
        help="torch threads of the compute loop standing for training (default 1)",
    )
    ap.add_argument(
        "--alone-s",
        type=float,
        default=1.0,
        help="seconds of compute alone before and after each interference run",
    )
    ap.add_argument(
        "--interference-runs",
        type=int,
        default=5,
        help="timed runs of each interference figure (noisy: default 5)",
    )
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="multi-rank timeout, seconds")
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error("--ranks must be ≥ 1")
    size = parse_size(args.size)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    created = args.dir is None
    root = default_dir() if created else os.path.abspath(args.dir)
    os.makedirs(root, exist_ok=True)
    free = __import__("shutil").disk_usage(root).free
    if free < 3 * size:
        ap.error(f"{root}: {fmt_bytes(free)} free, need ≥ {fmt_bytes(3 * size)}")
    machine = machine_info(root)
    dropping = machine["drop_caches"]
    cfg = {
        "size": size,
        "runs": max(1, args.runs),
        "warmup": max(0, args.warmup),
        "compute_threads": args.compute_threads,
        "alone_s": args.alone_s,
        "interference_runs": args.interference_runs,
        "sections": sections,
        "drop_caches": dropping,
        "timeout_s": args.timeout,
    }
    log(
        f"state {fmt_bytes(size)} over {args.ranks} rank(s), checkpoints in {root}; "
        f"page cache drop {'permitted' if dropping else 'NOT permitted'}"
    )
    t0 = time.perf_counter()
    try:
        results = run_ranks(args.ranks, cfg, root)
    finally:
        if created:
            remove(root)
    elapsed = time.perf_counter() - t0
    machine["loadavg_at_end"] = os.getloadavg()
    rep = Report(results, cfg)
    rep.build()
    info = results[0]["info"]
    sh = info["shape"]
    title = (
        f"**ckptd save benchmark** — {fmt_bytes(rep.nbytes)} state ({info['ntensors']} "
        f"tensors per rank: {sh['layers']}-layer transformer, hidden {sh['hidden']}, ffn "
        f"{sh['ffn']}, vocab {sh['vocab']}; bf16 params + fp32 master/exp_avg/exp_avg_sq) "
        f"on {args.ranks} rank(s); median of {cfg['runs']} runs after {cfg['warmup']} "
        f"warm-up; ckptd {machine.get('ckptd')}"
        + (f" (git {machine['git']})" if machine.get("git") else "")
        + "; "
        f"torch {torch.__version__}, {machine['nproc']} CPUs, load avg "
        f"{machine['loadavg_at_start'][0]:.1f} → {machine['loadavg_at_end'][0]:.1f}; "
        f"run took {elapsed:.0f} s"
    )
    notes = [
        "Times are from the call until the figure's event; 'durable' includes the fsync of "
        "every new directory (DCP and ckptd both fsync their files, neither fsyncs every "
        "directory of a fresh checkpoint, so the benchmark does it for both, inside the timing).",
        "vs floor: for stalls, time ÷ memcpy time (lower is better); for writes, throughput "
        "÷ the best write floor's throughput (higher is better). vs DCP: stall ÷ DCP's "
        "best time-until-state-may-be-modified; durable throughput ÷ DCP async_save's best "
        "durable throughput.",
        "spread = (max − min) ÷ median over the runs (the noisiest rank for --ranks > 1). "
        "With --ranks > 1 the median column is the slowest rank's median (times), the sum "
        "over ranks (compute it/s), or Σ alone ÷ Σ during over ranks (slowdowns).",
        "page cache: "
        + (
            "dropped before every run"
            if dropping
            else "NOT dropped (writing /proc/sys/vm/drop_caches is not permitted "
            "here); every write is fsynced and files are deleted between runs"
        ),
    ]
    for r in results:
        notes.extend(r.get("notes", [])[:1])
    out = title + "\n\n" + rep.markdown() + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    print(out, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "config": cfg,
                    "machine": machine,
                    "dir": root,
                    "nbytes": rep.nbytes,
                    "elapsed_s": elapsed,
                    "rows": rep.rows,
                    "targets": rep.targets,
                    "notes": notes,
                    "ranks": results,
                    "markdown": out,
                },
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
