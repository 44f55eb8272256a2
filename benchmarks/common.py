"""Shared helpers for the benchmarks: sizes, the machine, a realistic training state, floors,
a compute loop that stands for training, and fsync helpers.

Nothing here imports ckptd, so the floors measure the machine, not the library.

The benchmarks measure the in-process save path unless they ask for the node agent (``agent.py``,
``peer_copy.py`` and ``handover.py`` do, and ``CKPTD_AGENT=1`` in the environment makes every
other one measure it too): importing this module sets ``CKPTD_AGENT=0`` when it is unset, so that
no benchmark leaves an agent, with the newest step it kept in memory, behind it.
"""

from __future__ import annotations

import contextlib
import errno
import math
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("CKPTD_AGENT", "0")

import torch  # noqa: E402
import torch.distributed as dist

# ----------------------------------------------------------------------------- sizes & stats

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """``"2GiB"`` -> 2147483648; ``"512MB"`` -> 512000000; a plain number is bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 2GiB, 512MiB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{int(n)} B"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median: how noisy a figure was across runs."""
    if len(xs) < 2:
        return 0.0
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else 0.0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# ----------------------------------------------------------------------------- machine & dirs


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "(unavailable)"


def machine_info(directory: str | None) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    info: dict[str, Any] = {
        "nproc": _run(["nproc"]),
        "cpu": cpu,
        "free_h": _run(["free", "-h"]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": os.getloadavg(),
        "drop_caches": can_drop_caches(),
    }
    if directory:
        info["df_T"] = _run(["df", "-hT", directory])
    try:
        import ckptd

        pkg = os.path.dirname(os.path.dirname(os.path.abspath(ckptd.__file__)))
        info["ckptd"] = f"{ckptd.__version__} from {pkg}"
        info["git"] = _run(["git", "-C", pkg, "describe", "--always", "--dirty"])
    except ImportError:
        info["ckptd"] = "(not importable)"
    return info


def can_drop_caches() -> bool:
    """Whether ``echo 3 > /proc/sys/vm/drop_caches`` is permitted here (tries it once)."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_caches() -> bool:
    os.sync()
    return can_drop_caches()


def default_dir() -> str:
    """A fresh directory in $CKPTD_BENCH_DIR, or else on the candidate filesystem with the most
    free space (/work, the temp dir, the current directory) — not tmpfs."""
    if os.environ.get("CKPTD_BENCH_DIR"):
        return tempfile.mkdtemp(prefix="ckptd-bench-", dir=os.environ["CKPTD_BENCH_DIR"])
    candidates = ["/work", tempfile.gettempdir(), os.getcwd()]
    best, best_free = None, -1
    for c in candidates:
        if not c or not os.path.isdir(c) or not os.access(c, os.W_OK):
            continue
        if _fs_type(c) in ("tmpfs", "ramfs"):
            continue
        free = shutil.disk_usage(c).free
        if free > best_free:
            best, best_free = c, free
    return tempfile.mkdtemp(prefix="ckptd-bench-", dir=best or tempfile.gettempdir())


@contextlib.contextmanager
def scratch(given: str | None) -> Iterator[str]:
    """``given`` (created if missing, left as it is afterwards), or a fresh :func:`default_dir`
    removed with everything in it afterwards — also when the benchmark fails or is
    interrupted, so that no run leaves gigabytes behind on the disk it measured."""
    if given:
        os.makedirs(given, exist_ok=True)
        yield given
        return
    path = default_dir()
    try:
        yield path
    finally:
        remove(path)


def _fs_type(path: str) -> str:
    out = _run(["df", "--output=fstype", path]).splitlines()
    return out[-1].strip() if len(out) > 1 else ""


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        if os.path.isfile(path):
            os.unlink(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str, files: bool = False) -> None:
    """fsync every directory under ``path`` (and its parent), optionally every file too: what
    "durable" needs for a new directory tree on a POSIX filesystem."""
    for d, _, names in os.walk(path):
        if files:
            for n in names:
                fd = os.open(os.path.join(d, n), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(d)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


# ----------------------------------------------------------------------------- memory & floors

ALIGN = 4096


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A zeroed (so: touched, no page faults later) uint8 tensor, 4 KiB-aligned (O_DIRECT)."""
    raw = torch.zeros(nbytes + ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift : shift + nbytes]


def write_fsync(path: str, mem: memoryview, direct: bool, block: int = 64 << 20) -> float | None:
    """Write ``mem`` to a new file sequentially in ``block`` calls, fsync, close; seconds.
    None if the filesystem refuses O_DIRECT (EINVAL)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t = time.perf_counter()
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if direct and e.errno == errno.EINVAL:
            return None
        raise
    try:
        for i in range(0, len(mem), block):
            part = mem[i : i + block]
            done = 0
            while done < len(part):
                done += os.write(fd, part[done:])
        os.fsync(fd)
    except OSError as e:
        if direct and e.errno == errno.EINVAL:
            return None
        raise
    finally:
        os.close(fd)
    return time.perf_counter() - t


def write_fsync_parallel(paths: Sequence[str], mem: memoryview, direct: bool) -> float | None:
    """``mem`` cut into len(paths) 4 KiB-aligned ranges, one file each, one thread each."""
    n = len(mem)
    k = len(paths)
    cuts = [min(n, -(-(n * i // k) // ALIGN) * ALIGN) for i in range(k + 1)]
    cuts[-1] = n
    out: list[float | None] = [None] * k
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            out[i] = write_fsync(paths[i], mem[cuts[i] : cuts[i + 1]], direct)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(k)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    if errors:
        raise errors[0]
    return None if any(x is None for x in out) else elapsed


# ----------------------------------------------------------------------------- training state


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer (LLaMA-like, with qkv bias) trained with mixed-precision Adam:
    bf16 parameters, fp32 master weights, fp32 exp_avg and exp_avg_sq: 14 bytes per parameter."""

    layers: int
    hidden: int
    ffn: int
    vocab: int

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        h, f, v = self.hidden, self.ffn, self.vocab
        out: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (v, h))]
        for i in range(self.layers):
            p = f"layers.{i}"
            out += [
                (f"{p}.attn_norm.weight", (h,)),
                (f"{p}.attn.qkv.weight", (3 * h, h)),
                (f"{p}.attn.qkv.bias", (3 * h,)),
                (f"{p}.attn.o.weight", (h, h)),
                (f"{p}.mlp_norm.weight", (h,)),
                (f"{p}.mlp.up.weight", (f, h)),
                (f"{p}.mlp.down.weight", (h, f)),
            ]
        out += [("norm_f.weight", (h,)), ("lm_head.weight", (v, h))]
        return out

    def nparams(self) -> int:
        return sum(math.prod(s) for _, s in self.params())


BYTES_PER_PARAM = 2 + 4 + 4 + 4
GROUPS = (
    ("model", torch.bfloat16),
    ("optim/master", torch.float32),
    ("optim/exp_avg", torch.float32),
    ("optim/exp_avg_sq", torch.float32),
)


def plan_shape(total_bytes: int, layers: int = 8, world: int = 4) -> Shape:
    """The transformer whose training state is closest to (not above) ``total_bytes``: hidden a
    multiple of 128 with the layers holding ~2/3 of the parameters, then the vocabulary (a
    multiple of 64 * world, so every dim 0 splits evenly over ``world`` ranks) fills the rest."""
    budget = total_bytes // BYTES_PER_PARAM
    hidden = 128
    while layers * (12 * (hidden + 128) ** 2 + 5 * (hidden + 128)) <= 0.66 * budget:
        hidden += 128
    q = 64 * world
    base = Shape(layers, hidden, 4 * hidden, 0).nparams()
    vocab = max(q, (budget - base) // (2 * hidden) // q * q)
    return Shape(layers, hidden, 4 * hidden, vocab)


@dataclass
class Leaf:
    name: str  # "model/layers.0.attn.qkv.weight"
    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass
class State:
    """One rank's share of the training state: dim 0 of every tensor split evenly over ranks."""

    shape: Shape
    rank: int
    world: int
    leaves: list[Leaf] = field(default_factory=list)
    step: int = 100

    @property
    def nbytes(self) -> int:
        return sum(lf.local.numel() * lf.local.element_size() for lf in self.leaves)

    @property
    def ntensors(self) -> int:
        return len(self.leaves)

    def _tree(self, leaf: Callable[[Leaf], Any]) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for lf in self.leaves:
            prefix, _, fqn = lf.name.rpartition("/")
            node = tree
            for key in prefix.split("/"):
                node = node.setdefault(key, {})
            node[fqn] = leaf(lf)
        tree["step"] = self.step
        return tree

    def plain(self) -> dict[str, Any]:
        """Local tensors as a nested state dict (torch.save; single-rank ckptd / DCP)."""
        return self._tree(lambda lf: lf.local)

    def ckptd_tree(self) -> dict[str, Any]:
        if self.world == 1:
            return self.plain()
        import ckptd

        return self._tree(lambda lf: ckptd.Shard(lf.local, lf.global_shape, lf.offsets))

    def dcp_tree(self, mesh: Any) -> dict[str, Any]:
        if self.world == 1:
            return self.plain()
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import Shard as DShard

        def dt(lf: Leaf) -> Any:
            return DTensor.from_local(
                lf.local,
                mesh,
                [DShard(0)],
                run_check=False,
                shape=torch.Size(lf.global_shape),
                stride=_contiguous_stride(lf.global_shape),
            )

        return self._tree(dt)

    def touch(self) -> None:
        """Modify the state slightly (as an optimizer step would) so saves are not of identical
        bytes; cheap compared to a save (adds to 1 element per tensor)."""
        with torch.no_grad():
            for lf in self.leaves:
                lf.local.view(-1)[:1].add_(1)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def build_state(total_bytes: int, rank: int = 0, world: int = 1, layers: int = 8,
                fill: bool = True) -> State:
    """This rank's 1/world of a training state of ~``total_bytes`` (all ranks together).

    Values are realistic for compression: weights ~ N(0, 0.02) (bf16 and fp32 master), exp_avg ~
    N(0, 1e-3), exp_avg_sq = exp_avg²-like (positive, tiny), norms ~ 1; generated per tensor
    from a seeded generator (each rank only makes its own share). ``fill=False``: the same
    tensors allocated and left empty (what a restart loads into)."""
    shape = plan_shape(total_bytes, layers, max(world, 4))
    state = State(shape, rank, world)
    for group, dtype in GROUPS:
        for fqn, gshape in shape.params():
            rows = gshape[0] // world
            local_shape = (rows, *gshape[1:])
            t = (_values(group, fqn, rank, local_shape, dtype) if fill
                 else torch.empty(local_shape, dtype=dtype))
            state.leaves.append(Leaf(f"{group}/{fqn}", t, gshape,
                                     (rank * rows,) + (0,) * (len(gshape) - 1)))
    return state


def _values(group: str, fqn: str, rank: int, shape: tuple[int, ...],
            dtype: torch.dtype) -> torch.Tensor:
    """One tensor of :func:`build_state`, seeded by its name and rank."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{group}/{fqn}/{rank}".encode()))
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    if "norm" in fqn:
        t.mul_(0.05).add_(1.0) if group in ("model", "optim/master") else t.mul_(1e-4)
    elif group in ("model", "optim/master"):
        t.mul_(0.02)
    elif group == "optim/exp_avg":
        t.mul_(1e-3)
    if group == "optim/exp_avg_sq":
        t.mul_(1e-3).square_()
    return t.to(dtype) if dtype != t.dtype else t


# ----------------------------------------------------------------------------- compute loop



def floor_write(path: str, buf: torch.Tensor) -> float:
    """The write floor of one step on every rank of the group: ``buf`` (4 KiB-aligned, see
    :func:`aligned_empty`) written to a new file ``path`` with O_DIRECT and fsync, the ranks
    starting together; the slowest rank's seconds. The file is removed."""
    dist.barrier()
    t0 = time.perf_counter()
    write_fsync(path, memoryview(buf.numpy()), direct=True)  # type: ignore[arg-type]
    took = slowest(time.perf_counter() - t0)
    os.remove(path)
    return took


def slowest(seconds: float, op: dist.ReduceOp.RedOpType = dist.ReduceOp.MAX) -> float:
    """Over every rank of the process group: the largest (or, with ``op=SUM``, the total) of
    ``seconds``."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes spinning on the cores meanwhile (users' nodes are never idle)."""
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,)) for _ in range(n)]
    for p in spinners:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in spinners:
            p.join()


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set, as it was again afterwards (the agents a benchmark
    starts inherit it)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class Compute:
    """What stands for training: 512×512 fp32 matmuls (GIL released inside) plus a few tiny ops
    per iteration (Python dispatch that needs the GIL, as a real training step has thousands of)."""

    def __init__(self, n: int = 512, small_ops: int = 8, threads: int | None = 1) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=g)
        self.b = torch.randn(n, n, generator=g) / n
        self.c = torch.empty(n, n)
        self.s = torch.zeros(64)
        self.small_ops = small_ops
        self.threads = threads

    def step(self) -> None:
        torch.mm(self.a, self.b, out=self.c)
        for _ in range(self.small_ops):
            self.s.add_(1.0)

    def rate_for(self, seconds: float) -> float:
        """Iterations per second over ``seconds``."""
        with torch_threads(self.threads):
            n, t0 = 0, time.perf_counter()
            while True:
                self.step()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= seconds:
                    return n / dt

    def rate_until(self, done: Callable[[], bool]) -> tuple[float, float, int]:
        """Iterate until ``done()``; (iterations per second, seconds, iterations)."""
        with torch_threads(self.threads):
            n, t0 = 0, time.perf_counter()
            while not done():
                self.step()
                n += 1
            dt = time.perf_counter() - t0
        return (n / dt if dt > 0 else float("nan")), dt, n
