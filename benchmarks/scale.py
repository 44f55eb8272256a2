"""Scale benchmark: the metadata path of a job of up to a thousand ranks, simulated in one process.

    python benchmarks/scale.py --model 70b --layout tp8 --world 1024
    python benchmarks/scale.py --model 8b --layout zero3 --world 8,128,256,512,1024

Every rank of a W-rank job saves through the public API, one after another in this process
(``Checkpointer(root, rank=r, world_size=W)``, ranks W-1 … 1 first, rank 0 — the coordinator —
last), with tiny tensors but the real counts of a Llama-shaped model with Adam state: every
dimension is divided by ``--shrink`` (64: a 2-d tensor has 4096 × fewer elements) and the frame
size by the same element factor, so the numbers of logical tensors, chunks and frames are those of
the real job. Every rank also saves what every real job has per rank: its RNG state (a tensor,
``ckptd.Local``) and its data position (a value). Then one rank's share is loaded at W/2 and
3W/4 ranks (same layout family).

Figures are CPU seconds of this process (``time.process_time``), not wall:
- manifest: bytes of ``manifest.json`` (and of the frame tables beside the data); partial bytes
  are the largest rank's partial; coordinator input: the bytes of every rank's partial (what
  the coordinator reads and parses);
- coordinator: rank 0's ``save_async(...).result()`` (its own small share, reading every partial,
  the merge and coverage check, the commit) while ranks 1 … W-1 wait. Their waiting threads live
  in this process and poll meanwhile; their CPU (read per thread from its clock) is subtracted
  and shown in parentheses: in a job they are other processes. Its RSS: the peak resident set
  during it (``VmHWM``, reset before) above the resident set before it, which the ranks saved
  before it also use — an upper bound of what a coordinator process adds;
- learn committed: rank 1's save thread, from the commit to its handle's ``result()``: it is
  held in its wait's poll until the commit is written, then polls once, reads the manifest's
  lead, completes the handle and writes its metrics line (its thread's CPU clock);
- load: one rank's ``load`` at W/2 and at 3W/4, median of three: the CPU of the whole load
  (every thread: the tiny data's reads and copies too, with the real frame counts) and, in
  parentheses, of its metadata (``LoadStats.metadata_cpu_s``: reading and decoding the manifest,
  the check, the plan); peak Python-heap bytes (tracemalloc, in a further identical load) and
  peak RSS above the RSS before it (``VmHWM``, reset before; in the first load), manifest
  entries decoded, frames read;
- full decode: what every rank paid before format 3 — every tensor's chunks and frames;
- what the loading rank reads and opens (its first load, a restart): bytes of
  ``manifest.json`` it read (the loading Checkpointer's storage counts them; a simulated rank
  has no process group, so it reads the manifest's head and its own entries, as rank 0 of a
  job does: the other ranks of a job with one get the head over the group and read their
  entries alone; format 4 and older: the whole file), the files it opened
  (data files, frame tables, others), and the ``open`` calls its storage made for them,
  directories included.

Growth exponents are least-squares fits of log(cost) over log(W) over every world size >= 64
(three at least, else none is printed).

Non-coordinator ranks wait for the commit in their save threads; while this process saves the
other ranks their polls are slowed (``poll_min_s`` 10 s) so a thousand waiting threads do not
compete with the ranks being saved and the coordinator for this one interpreter (in a job each
waits in its own process); rank 0 is timed after every partial is on disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CKPTD_AGENT", "0")  # every simulated rank saves in this process

import torch  # noqa: E402

import ckptd  # noqa: E402
from ckptd import catalog, config  # noqa: E402
from ckptd.loader.load import last_stats  # noqa: E402
from ckptd.manifest import layout as L  # noqa: E402
from ckptd.storage.local import LocalStorage  # noqa: E402


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    ffn: int
    vocab: int
    kv: int  # width of k and v (kv heads × head dim)


MODELS = {"8b": Model(32, 4096, 14336, 128256, 1024), "70b": Model(80, 8192, 28672, 128256, 1024)}
TP = 8


def params(m: Model, shrink: int) -> list[tuple[str, tuple[int, ...], int]]:
    """``(name, shape, tp_dim)`` of every parameter, each dimension divided by ``shrink`` and
    rounded up to a multiple of 8 (so TP 8 still divides it); tp_dim -1: replicated."""
    def d(n: int) -> int:
        return max(8, -(-n // shrink // 8) * 8)
    h, f, v, kv = d(m.hidden), d(m.ffn), d(m.vocab), d(m.kv)
    out: list[tuple[str, tuple[int, ...], int]] = [("embed", (v, h), 0)]
    for i in range(m.layers):
        p = f"layers.{i}."
        out += [(p + "attn.q", (h, h), 0), (p + "attn.k", (kv, h), 0), (p + "attn.v", (kv, h), 0),
                (p + "attn.o", (h, h), 1), (p + "mlp.gate", (f, h), 0), (p + "mlp.up", (f, h), 0),
                (p + "mlp.down", (h, f), 1), (p + "norm1", (h,), -1), (p + "norm2", (h,), -1)]
    return out + [("norm", (h,), -1), ("lm_head", (v, h), 0)]


OPTIM = ("master", "exp_avg", "exp_avg_sq")  # fp32, beside the bf16 model


def state_for(ps: list[tuple[str, tuple[int, ...], int]], layout: str, world: int, rank: int,
              ) -> dict[str, object]:
    out = _model_state(ps, layout, world, rank)
    # what every job saves per rank: its RNG state (a tensor) and its data position
    gen = torch.Generator().manual_seed(rank)
    out["rng"] = ckptd.Local(gen.get_state())
    out["data"] = ckptd.Local({"epoch": 0, "position": 1000 * rank})
    return out


def _model_state(ps: list[tuple[str, tuple[int, ...], int]], layout: str, world: int, rank: int,
                 ) -> dict[str, object]:
    if layout == "zero3":
        return _flat_state([(n, s) for n, s, _ in ps], world, rank)
    tp = math.gcd(TP, world)
    dp, t = divmod(rank, tp)
    model: dict[str, object] = {}
    members: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
    for name, shape, dim in ps:
        offs, sizes = [0] * len(shape), list(shape)
        if dim >= 0:
            sizes[dim] = shape[dim] // tp
            offs[dim] = t * sizes[dim]
            replica, replicas = dp, world // tp
        else:
            replica, replicas = rank, world
        local = torch.zeros(sizes, dtype=torch.bfloat16)
        model[name] = ckptd.Shard(local, shape, offs, replica=replica, replicas=replicas)
        members.append((name, shape, tuple(offs), tuple(sizes)))
    out = _flat_state(members, world // tp, dp)
    out["model"] = model
    return out


def _flat_state(members: list, world: int, rank: int) -> dict[str, object]:
    """ZeRO: flat buffers of ``members`` (whole tensors, or TP boxes of them) split evenly over
    ``world`` ranks; with whole tensors (ZeRO-3) the bf16 model is flat-sharded too."""
    numel = sum(math.prod(m[3] if len(m) == 4 else m[1]) for m in members)
    per = -(-numel // world)
    start = min(rank * per, numel)
    n = min(per, numel - start)
    out: dict[str, object] = {"optim": {k: {"flat": ckptd.FlatShard(torch.zeros(n), members, start)}
                                        for k in OPTIM}}
    if all(len(m) == 2 for m in members):
        out["model"] = {"flat": ckptd.FlatShard(torch.zeros(n, dtype=torch.bfloat16), members,
                                                start)}
    return out




def cpu(fn, *args, **kw):  # type: ignore[no-untyped-def]
    gc.collect()
    t0 = time.process_time()
    out = fn(*args, **kw)
    return out, time.process_time() - t0


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss(fn, *args, **kw):  # type: ignore[no-untyped-def]
    """``fn``'s result and the peak resident set during it above the one before it (the peak
    reset first through ``/proc/self/clear_refs``)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    out = fn(*args, **kw)
    return out, max(0, _rss("VmHWM") - before)


def peak_heap(fn, *args, **kw) -> int:  # type: ignore[no-untyped-def]
    gc.collect()
    tracemalloc.start()
    try:
        fn(*args, **kw)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class Waiters:
    """The CPU seconds of every thread alive when made, but this one."""

    def __init__(self) -> None:
        me = threading.get_ident()
        self.clocks = {t.ident: time.pthread_getcpuclockid(t.ident)
                       for t in threading.enumerate() if t.ident not in (me, None)}
        self.last: dict[int, float] = {}

    def cpu(self) -> float:
        for ident, clock in self.clocks.items():
            try:
                self.last[ident] = time.clock_gettime(clock)
            except OSError:  # it ended: its last reading stands (the coordinator's figure
                pass  # can only come out higher for it)
        return sum(self.last.values())


@dataclass
class Row:
    model: str
    layout: str
    world: int
    tensors: int
    chunks: int
    frames: int
    manifest_bytes: int
    tables_bytes: int
    partial_max_bytes: int
    coordinator_input_bytes: int  # every partial
    save_all_s: float
    coordinator_s: float
    coordinator_rss: int
    waiters_s: float  # the other ranks' save threads polling meanwhile (excluded from the above)
    learn_committed_s: float
    full_decode_s: float
    loads: list[dict[str, float]]


class Held(LocalStorage):
    """Rank 1's storage: its wait for the commit is held in its first poll until
    :attr:`go` is set (after the commit), and says which thread polls."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.go, self.polling = threading.Event(), threading.Event()
        self.thread = 0

    def probe(self, paths):  # type: ignore[no-untyped-def]
        import contextlib

        @contextlib.contextmanager
        def held():  # type: ignore[no-untyped-def]
            with LocalStorage.probe(self, paths) as ask:
                def poll() -> list[bool]:
                    if not self.go.is_set():
                        self.thread = threading.get_ident()
                        self.polling.set()
                        self.go.wait()
                    return ask()
                yield poll
        return held()


class Counting(LocalStorage):
    """A loading rank's storage: counts the bytes of ``manifest.json`` it reads, the files it
    opens (each regular file opened, by path) and the ``open`` calls they cost (directories
    walked on the way included)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reset()

    def reset(self) -> None:
        self.manifest_bytes, self.opens = 0, 0
        self.files: list[str] = []

    def kinds(self) -> dict[str, int]:
        """Files opened: data files, frame tables, others (the manifest...)."""
        data = sum(1 for p in self.files if "/data/" in p and not p.endswith(".frames"))
        tables = sum(1 for p in self.files if p.endswith(".frames"))
        return {"data_files": data, "table_files": tables,
                "other_files": len(self.files) - data - tables}

    def read_bytes(self, path: str) -> bytes:
        out = super().read_bytes(path)
        if path.endswith(L.MANIFEST):
            self.manifest_bytes += len(out)
        return out

    def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
        out = super().read_ranges(path, ranges)
        if path.endswith(L.MANIFEST):
            self.manifest_bytes += sum(len(b) for b in out)
        return out

    def _open_file(self, path, flags, create_dirs=False):  # type: ignore[no-untyped-def]
        self.files.append(path)
        return super()._open_file(path, flags, create_dirs)

    def open_read(self, paths):  # type: ignore[no-untyped-def]
        """A load holds the manifest open and reads its head and entries through a session:
        those reads are counted too."""
        session = super().open_read(paths)
        if any(p.endswith(L.MANIFEST) for p in paths):
            inner, counting = session.read_into, self

            def read_into(path, offset, buf):  # type: ignore[no-untyped-def]
                inner(path, offset, buf)
                if path.endswith(L.MANIFEST):
                    counting.manifest_bytes += len(buf)
            session.read_into = read_into
        return session


def count_opens(storage: Counting, fn, *args, **kw):  # type: ignore[no-untyped-def]
    """``fn(...)``, counting into ``storage.opens`` every file and directory a LocalStorage
    opens meanwhile (its ``open_at`` and, where there is one, ``open_beneath``; the loads here
    run alone: nothing else opens files)."""
    import ckptd.storage.local as local

    real = {n: getattr(local, n) for n in ("open_at", "open_beneath") if hasattr(local, n)}

    def counting(f):  # type: ignore[no-untyped-def]
        def counted(*a, **k):  # type: ignore[no-untyped-def]
            fd = f(*a, **k)
            storage.opens += fd is not None
            return fd
        return counted

    for n, f in real.items():
        setattr(local, n, counting(f))
    try:
        return fn(*args, **kw)
    finally:
        for n, f in real.items():
            setattr(local, n, f)


def run(model: str, layout_name: str, world: int, shrink: int, root: str) -> Row:
    ps = params(MODELS[model], shrink)
    scale = shrink * shrink  # the element factor of a 2-d tensor
    run_id = f"scale{world}"
    step = 1
    with config.override(frame_bytes=(1 << 20) // scale, min_frame_bytes=(256 << 10) // scale,
                         poll_min_s=10.0, poll_max_s=20.0, commit_timeout_s=3600.0):
        others, handles = [], []
        t0 = time.process_time()
        held = Held(root)
        for r in range(world - 1, 0, -1):
            c = ckptd.Checkpointer(root, rank=r, world_size=world, run_id=run_id, threads=1,
                                   keep_last=0, storage=held if r == 1 else None)
            handles.append(c.save_async(state_for(ps, layout_name, world, r), step=step))
            others.append(c)
        storage = LocalStorage(root)
        attempt = f"{run_id}-000001"
        partials = L.partials_dir(step, attempt)
        while sum(L.is_partial(n) for n in storage.list_dir(partials)) < world - 1:
            time.sleep(0.05)  # the last saves' threads are still writing their partials
        save_all = time.process_time() - t0
        # every thread alive now is another rank's (its save thread waiting for the commit):
        # their CPU is subtracted from the process's (in a real job they are other processes)
        waiters = Waiters()
        first = ckptd.Checkpointer(root, rank=0, world_size=world, run_id=run_id, threads=1,
                                   keep_last=0)
        state0 = state_for(ps, layout_name, world, 0)
        gc.collect()
        t0, w0 = time.process_time(), waiters.cpu()
        _, coordinator_rss = peak_rss(lambda: first.save_async(state0, step=step).result())
        waited = waiters.cpu() - w0
        coordinator = time.process_time() - t0 - waited
        # rank 1 learns the commit through its handle: its save thread's CPU from here
        assert held.polling.wait(600)
        clock = time.pthread_getcpuclockid(held.thread)
        l0 = time.clock_gettime(clock)
        held.go.set()
        handles[-1].result()
        learn = time.clock_gettime(clock) - l0
        for h in handles:
            h.result()
        for c in [first, *others]:
            c.close()
    del others, handles
    sd = L.step_dir(step)
    manifest_bytes = storage.size(L.manifest_path(step))
    files = storage.list_dir(f"{sd}/data/{attempt}")
    tables = sum(storage.size(f"{sd}/data/{attempt}/{f}") for f in files if f.endswith(".frames"))
    partial_sizes = [storage.size(f"{partials}/{n}") for n in storage.list_dir(partials)
                     if L.is_partial(n)]

    def full_decode() -> tuple[int, int]:
        m = catalog.read_manifest(storage, step)
        chunks = m.with_frames([(n, c) for n, e in m.tensors.items() for c in e.chunks])
        return len(chunks), sum(len(c.frames) for c in chunks)

    (n_chunks, n_frames), decode = cpu(full_decode)
    loads = []
    for target in sorted({max(1, world // 2), max(1, 3 * world // 4)}):
        rank = target // 2
        counting = Counting(root)
        reader = ckptd.Checkpointer(root, rank=rank, world_size=target, read_only=True,
                                    run_id=run_id, threads=1, storage=counting)
        dest = state_for(ps, layout_name, target, rank)
        runs, meta = [], []
        counting.reset()
        count_opens(counting, reader.load, dest, step=step)  # the first load: a restart
        opened = {"manifest_read": counting.manifest_bytes, "open_calls": counting.opens,
                  **counting.kinds()}
        _, load_rss = peak_rss(reader.load, dest, step=step)
        for _ in range(3):  # a noisy host: the median of three
            result, load_s = cpu(reader.load, dest, step=step)
            stats = last_stats()
            assert stats is not None
            runs.append(load_s)
            meta.append(stats.metadata_cpu_s)
        peak = peak_heap(reader.load, dest, step=step)
        reader.close()
        loads.append({"world": target, "cpu_s": statistics.median(runs),
                      "metadata_cpu_s": statistics.median(meta), "peak_bytes": peak,
                      "peak_rss": load_rss,
                      "tensors_decoded": result.tensors_decoded,
                      "frames_read": result.frames_read, "bytes_read": result.nbytes_read,
                      **opened})
    return Row(model, layout_name, world, len(ps) * 4, n_chunks, n_frames, manifest_bytes, tables,
               max(partial_sizes), sum(partial_sizes), save_all, coordinator, coordinator_rss,
               waited, learn, decode, loads)


def exponent(rows: list[Row], key) -> float | None:  # type: ignore[no-untyped-def]
    """The least-squares slope of log(cost) over log(W) over every W >= 64 (None with fewer
    than three such world sizes, or a cost that is not positive)."""
    pts = sorted((r.world, key(r)) for r in rows if r.world >= 64)
    if len({w for w, _ in pts}) < 3 or any(c <= 0 for _, c in pts):
        return None
    xs, ys = [math.log(w) for w, _ in pts], [math.log(c) for _, c in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
            / sum((x - mx) ** 2 for x in xs))


def mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def render(rows: list[Row]) -> str:
    out = ["| model, layout | W | tensors / chunks / frames | manifest (+ frame tables) | "
           "largest partial | coordinator input (every partial) | coordinator CPU (others' "
           "polls), RSS | learn committed (handle) | full decode | "
           "load at W/2, 3W/4: CPU (of it metadata), peak heap, peak RSS, entries decoded | "
           "load at W/2, 3W/4 (one rank, first load): manifest bytes read, files opened "
           "(data + frame tables + other), open calls |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        loads = "; ".join(
            f"W={d['world']}: {d['cpu_s'] * 1e3:.0f} ms ({d['metadata_cpu_s'] * 1e3:.0f} ms), "
            f"{d['peak_bytes'] / 2**20:.1f} MiB, {d['peak_rss'] / 2**20:.1f} MiB, "
            f"{d['tensors_decoded']}" for d in r.loads)
        opens = "; ".join(
            f"W={d['world']}: {mb(d['manifest_read'])}, {d['data_files']} + "
            f"{d['table_files']} + {d['other_files']}, {d['open_calls']}" for d in r.loads)
        out.append(
            f"| {r.model}, {r.layout} | {r.world} | {r.tensors} / {r.chunks} / {r.frames} | "
            f"{mb(r.manifest_bytes)} (+{mb(r.tables_bytes)}) | {mb(r.partial_max_bytes)} | "
            f"{mb(r.coordinator_input_bytes)} | "
            f"{r.coordinator_s:.2f} s ({r.waiters_s:.2f} s), {r.coordinator_rss / 2**20:.0f} MiB | "
            f"{r.learn_committed_s * 1e3:.1f} ms | {r.full_decode_s:.2f} s | {loads} | "
            f"{opens} |")
    worlds = [r.world for r in rows if r.world >= 64]
    for name, key in (("coordinator input bytes", lambda r: r.coordinator_input_bytes),
                      ("coordinator CPU", lambda r: r.coordinator_s),
                      ("coordinator RSS", lambda r: r.coordinator_rss),
                      ("load CPU (3W/4)", lambda r: r.loads[-1]["cpu_s"]),
                      ("load metadata CPU (3W/4)", lambda r: r.loads[-1]["metadata_cpu_s"])):
        e = exponent(rows, key)
        if e is not None:
            out.append(f"\ngrowth of {name} over W = {', '.join(map(str, worlds))} "
                       f"(least squares): W^{e:.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--layout", choices=("zero3", "tp8"), default="zero3")
    ap.add_argument("--world", default="8,128,1024",
                    help="comma-separated world sizes (default 8,128,1024)")
    ap.add_argument("--shrink", type=int, default=64, help="divide every dimension by this")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (print where)")
    args = ap.parse_args(argv)
    rows = []
    for w in (int(x) for x in args.world.split(",")):
        root = tempfile.mkdtemp(prefix=f"ckptd-scale-{w}-", dir=args.dir)
        try:
            t0 = time.perf_counter()
            rows.append(run(args.model, args.layout, w, args.shrink, root))
            print(f"W={w}: {time.perf_counter() - t0:.0f} s wall", file=sys.stderr, flush=True)
        finally:
            if args.keep:
                print(f"W={w}: kept {root}", file=sys.stderr)
            else:
                shutil.rmtree(root, ignore_errors=True)
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
