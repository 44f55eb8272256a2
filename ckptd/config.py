"""Tunables and settings in one place: every ``CKPTD_*`` environment variable ckptd reads is
read here.

* :class:`Tunables`: numbers of the save and load paths, each default explained next to it.
  Tests override them through :func:`override`, users through ``CKPTD_<NAME>`` (upper case).
* :class:`Setting`: the other variables (the node agent's, the run id, debugging), each with its
  parser, default and meaning; read when asked (:meth:`Setting.get`), so a launcher's
  environment is what counts. A value that does not parse is an error naming the variable.
* :func:`env_fields`: the same ``<PREFIX>_<FIELD>`` convention for another dataclass's fields
  (``CKPTD_S3_*`` for the S3 transfer settings).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from ckptd.errors import CkptdError

T = TypeVar("T")


@dataclasses.dataclass
class Tunables:
    # Raw bytes per checksummed (and, when compressed, independently decodable) frame, at most.
    # A partial read rounds out to whole frames, so a load that cuts a chunk (a reshard) reads up
    # to one frame too many at each cut. Chunks smaller than `frames_per_chunk` frames get
    # smaller frames (halved, down to `min_frame_bytes`), so the over-read stays within about
    # 1/64 of the chunk; large chunks keep `frame_bytes`, so the manifest of a big checkpoint
    # stays small (~1 entry per MiB). Measured on benchmarks/load.py's 2 GiB state: fixed 1 MiB
    # frames read 1.133x the needed bytes on 4 -> 8 ranks, fixed 256 KiB 1.033x (with 4x the
    # frame entries); docs/loading.md has the adaptive rule's figures. xxh3: ~0.04 ms per MiB.
    # Set min_frame_bytes = frame_bytes for fixed frames.
    frame_bytes: int = 1 << 20
    min_frame_bytes: int = 256 << 10
    frames_per_chunk: int = 64
    # Chunk start offsets in data files are aligned to this (O_DIRECT needs 4 KiB alignment).
    file_alignment: int = 4096
    # A rank's data is split into up to `files_per_thread * io_threads` files, written in
    # parallel and each started as soon as its part is staged (the disk works while the rest is
    # being copied), but no file is made smaller than this: tiny files cost more in metadata
    # than the overlap wins.
    min_file_bytes: int = 64 << 20
    files_per_thread: int = 4
    # How long the coordinator waits for every rank's partial manifest before giving up. A rank
    # that died mid-save therefore fails the commit after this long, leaving `latest` unchanged.
    commit_timeout_s: float = 600.0
    # A process ending on an unhandled error (typically a collective that failed because a peer
    # died) waits at most this long, from the moment it starts exiting, for the other ranks'
    # part of its in-flight saves: their partials on the coordinator, the commit elsewhere. A
    # killed rank's partial never comes, and torchrun restarts nobody while this process lives,
    # so `commit_timeout_s` would hold the whole job that long. The process still finishes its
    # own share first (its files and partial, or the hand-over to the node agent, which goes on
    # without it); a coordinator that gives up fails the step, the previous one stays `latest`.
    # A clean exit waits for the commit as before (up to `commit_timeout_s`).
    error_exit_wait_s: float = 30.0
    # A manifest larger than this is refused before it is parsed (every rank parses the
    # manifest it loads; a manifest of padding would otherwise cost each rank GBs of memory).
    # The largest real manifests in benchmarks/scale.py's simulations (Llama-70B with Adam, TP 8
    # x DP at 1024 ranks, format 2) are ~44 MB: 256 MiB leaves ~6x room.
    max_manifest_bytes: int = 256 << 20
    # `ckptd gc` aborts incomplete multipart uploads (S3) at least this old. An upload is only
    # useful to a save that can still commit: one whose ranks are still writing, or whose
    # coordinator is still waiting (at most `commit_timeout_s` after its own data is written).
    # An hour leaves a save's slowest data file an hour to upload; gc refuses any value not
    # above `commit_timeout_s`. Uploads under steps that gc removes as incomplete (older than
    # the newest commit) are aborted whatever their age: no save can commit them any more.
    gc_upload_min_age_s: float = 3600.0
    # Pause between two polls of storage while waiting for partials (coordinator) or for the
    # manifest (other ranks): it starts at the first value and doubles up to the second, each
    # pause drawn in [½, 1] of that (jitter, so that ranks do not poll in lockstep). These two
    # are for filesystems and memory://, where a poll is a cheap metadata call.
    poll_min_s: float = 0.001
    poll_max_s: float = 0.05
    # A wait that goes on polls less often: the longest pause grows to 1/8 of the time waited
    # so far, up to this (when it is above the storage's own longest). Each poll wakes a
    # thread, which costs ~0.1 ms of CPU on a loaded host (with its probe and store check): at
    # 50 ms that is ~5 ms of CPU per second of waiting on every rank, at 250 ms ~1 ms; the
    # commit of a save that took T seconds is learnt at most ~T/8 (and 0.25 s) late.
    poll_idle_max_s: float = 0.25
    # Where the kernel reports every change a rank waits for (a local filesystem, through
    # inotify: ckptd/storage/watch.py), a pause ends as soon as the change is made and the
    # polls are a safety net: a long wait's pause grows up to this instead (a failure the
    # process group's store publishes is learnt at the next poll).
    poll_watched_idle_max_s: float = 2.0
    # The same for object stores (S3 and other remote fsspec URLs; the storage reports its own
    # bounds through `poll_interval_s`, see ckptd/storage/base.py). A request there takes
    # 10-30 ms, so polling faster than every 50 ms only queues requests; and a waiting rank
    # makes 2 requests per poll (GET manifest, GET FAILED), so at the 1 s ceiling 1000 waiting
    # ranks make ~2000 GET/s on one prefix, under S3's 5500 GET/s per prefix. The price is at
    # most 1 s (plus a request) between the commit and its detection by a rank.
    remote_poll_min_s: float = 0.05
    remote_poll_max_s: float = 1.0
    # Host memory a load may use for read buffers beyond the destination tensors. Loads needing
    # more than this verify in a first streaming pass and copy in a second (see docs/format.md).
    load_budget_bytes: int = 512 << 20
    # Threads for background writes and parallel reads (None: min(4, cpu count)).
    io_threads: int | None = None
    # Threads for the staging copy, the caller's included (None: min(4, cpu count)); the
    # caller is blocked during the stall, so its cores are free (see writer/memcopy.py).
    stage_threads: int | None = None
    # Hand each data file to its writer as soon as it is staged (1), or stage everything first
    # (0). Overlapping saves up to the stall's length on time-to-durable, but the writers'
    # checksums and syscalls then compete with the staging copy for cores: on this 2-core VM
    # (`CKPTD_PIPELINED_STAGING=1|0 python benchmarks/save.py --size 2GiB --sections
    # floors,ckptd`) overlapped staging stalled 1.45x memcpy (durable 0.84x the write floor),
    # staging first 1.04x (durable 0.77x). None: overlap only when the machine has a core for
    # every staging and every I/O thread.
    pipelined_staging: int | None = None

    # --- read planning, reading and the offline reshard (benchmarks/load.py reproduces the
    # measurements behind these defaults; docs/loading.md has the numbers)
    # Two byte ranges of one file are read as one when the gap between them is at most this
    # (the gap is read and dropped). On a local disk a separate request costs about as much as
    # reading ~128-512 KiB (measured: benchmarks/load.py --section gap); 256 KiB is the middle.
    gap_bytes: int = 256 << 10
    # The same for remote object stores (fsspec URLs), where a request costs ~20-50 ms of
    # latency, i.e. several MiB at 100+ MB/s per connection (not measured here: no real S3).
    remote_gap_bytes: int = 4 << 20
    # The largest single ranged read, and the largest decoded piece of a chunk held at once: big
    # enough to stream at disk speed (4-16 MiB reads reach the sequential bandwidth here), small
    # enough that several are in flight in parallel threads within the load budget.
    unit_bytes: int = 8 << 20
    # The read unit for remote storage (fsspec URLs: S3...), at most a quarter of the load
    # budget: fewer, larger requests. A remote range's buffer is exactly its length (counted
    # against the budget as such), and the S3 backend fetches it by concurrent GETs of
    # ``S3Transfer.read_part_bytes``. Measurements: docs/storage.md, "Tuning loads from S3".
    remote_unit_bytes: int = 128 << 20
    # Read-once: replicated destination pieces (the same box of a tensor on several ranks) are
    # read by one rank and broadcast, when torch.distributed is initialised. "off" | "on" |
    # "remote" (on for fsspec URLs only). Measured on one node with a local disk it loses (the
    # page cache already serves the second reader; docs/loading.md), so it is off by default.
    read_once: str = "off"
    # Between the verify pass and the copy pass a load keeps the data it read, up to the load
    # budget, when the storage is remote (no page cache: reading again costs the network). On
    # a local filesystem it keeps it only when all of it fits in this many bytes; otherwise the
    # copy pass reads the ranges again, from the page cache, which is cheaper than the page
    # faults of holding fresh memory (benchmarks/README.md) and keeps the load's memory at a
    # few read units.
    local_hold_bytes: int = 64 << 20
    # Offline reshard: a replicated target piece (a box several target ranks hold) is written
    # once, as a save writes it: one chunk every holder reads; one of at most
    # ``replicate_small_bytes`` by its first holder (a restart opens one more file for all of
    # them), a larger one by the holder with the fewest bytes so far. ``replicate_max_share``
    # > 0 writes the small ones into every holder's files instead (each rank then reads only its
    # own files) while the extra copies together stay within that share of the checkpoint's
    # bytes, smallest first: at 1024 ranks each 0-d Adam step would be 1,024 chunks.
    replicate_small_bytes: int = 1 << 20
    replicate_max_share: float = 0.0


_current = Tunables()


def _from_env() -> None:
    for field in dataclasses.fields(Tunables):
        raw = os.environ.get(f"CKPTD_{field.name.upper()}")
        if raw is None:
            continue
        kind = type(getattr(_current, field.name))
        value: Any = raw if kind is str else float(raw) if kind is float else int(raw)
        setattr(_current, field.name, value)


_from_env()


def get() -> Tunables:
    """The tunables in force."""
    return _current


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Tunables]:
    """Temporarily change tunables (tests)."""
    old = dataclasses.replace(_current)
    for k, v in changes.items():
        if not hasattr(_current, k):
            raise AttributeError(f"unknown tunable {k!r}")
        setattr(_current, k, v)
    try:
        yield _current
    finally:
        for f in dataclasses.fields(Tunables):
            setattr(_current, f.name, getattr(old, f.name))


def io_threads() -> int:
    n = _current.io_threads
    return n if n else max(1, min(4, os.cpu_count() or 1))


def stage_threads() -> int:
    n = _current.stage_threads
    return n if n else max(1, min(4, os.cpu_count() or 1))


def pipelined_staging(io_threads: int) -> bool:
    """Whether a save hands files to its ``io_threads`` writers while it is still staging."""
    if _current.pipelined_staging is not None:
        return bool(_current.pipelined_staging)
    return (os.cpu_count() or 1) >= stage_threads() + io_threads


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """``5GB`` (10^9), ``2GiB`` (2^30), ``500MB``, or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: want a number with an optional unit (5GB, 2GiB, 500MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


# ----------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class Setting(Generic[T]):
    """One ``CKPTD_*`` variable that is not a tunable. ``trainer_only``: read by the training
    process alone (not by the node agent: it does not name an agent's environment,
    ``ckptd.agent.wire.environment``); ``secret``: never written anywhere."""

    name: str
    parse: Callable[[str], T]
    default: T
    help: str
    trainer_only: bool = False
    secret: bool = False

    def get(self) -> T:
        """The variable's value, parsed; the default when unset or empty; a
        :class:`~ckptd.errors.CkptdError` naming it when it does not parse."""
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except (ValueError, TypeError) as e:
            shown = "***" if self.secret else repr(raw)
            raise CkptdError(f"{self.name}={shown}: {e}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    value = raw.lower()
    if value not in _ON + _OFF:
        raise ValueError("use 1 (a node agent) or 0 (save in process)")
    return value in _ON


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"use one of {', '.join(options)}")
        return raw
    return parse


def _parsed(kind: Callable[[str], T], what: str) -> Callable[[str], T]:
    def parse(raw: str) -> T:
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"not {what}") from None
    return parse


_number = _parsed(float, "a number")
_count = _parsed(int, "an integer")


def _size(raw: str) -> int:
    return parse_size(raw)


AGENT: Setting[bool | None] = Setting(
    "CKPTD_AGENT", _flag, None, "use the node agent (1) or save in process (0); unset: under "
    "a launcher on Linux", trainer_only=True)
AGENT_DIR: Setting[str | None] = Setting(
    "CKPTD_AGENT_DIR", str, None, "the node agents' socket directory (default <tmp>/ckptd-<uid>)",
    trainer_only=True)
NODE_ID: Setting[str | None] = Setting(
    "CKPTD_NODE_ID", str, None, "this node's identity (default: the host name)",
    trainer_only=True)
AGENT_TIMEOUT_S: Setting[float] = Setting(
    "CKPTD_AGENT_TIMEOUT_S", _number, 5.0, "silence after which a trainer declares its agent "
    "lost", trainer_only=True)
AGENT_DRAIN_S: Setting[float] = Setting(
    "CKPTD_AGENT_DRAIN_S", _number, 30.0, "how long a new Checkpointer waits for an earlier "
    "run's saves in the agent", trainer_only=True)
AGENT_MIN_BYTES: Setting[int] = Setting(
    "CKPTD_AGENT_MIN_BYTES", _size, 1 << 20, "a rank's save that stages fewer bytes than "
    "this is written by the process itself even where a node agent runs (0: every save "
    "through the agent)", trainer_only=True)
RUN_ID: Setting[str | None] = Setting(
    "CKPTD_RUN_ID", str, None, "the job's run id, shared by every rank", trainer_only=True)
DEBUG_OVERLAP: Setting[bool] = Setting(
    "CKPTD_DEBUG_OVERLAP", lambda raw: raw == "1", False, "check at wait_staged() that an "
    "overlapped save's state was not modified", trainer_only=True)
DEBUG: Setting[bool] = Setting(
    "CKPTD_DEBUG", lambda raw: raw not in _OFF, False, "the ckptd command prints tracebacks",
    trainer_only=True)
JOB_SECRET: Setting[bytes | None] = Setting(
    "CKPTD_JOB_SECRET", str.encode, None, "the per-job secret of peer copies (none: no peer "
    "copies)", secret=True)
AGENT_HOST: Setting[str] = Setting(
    "CKPTD_AGENT_HOST", str, "127.0.0.1", "the address peers reach this node's agent at")
PEER_COPIES: Setting[int] = Setting(
    "CKPTD_PEER_COPIES", _count, 1, "how many peers get each step's copy")
PEER_RATE: Setting[float] = Setting(
    "CKPTD_PEER_RATE", _number, 0.0, "bytes/s a peer copy is paced to (0: unlimited)")
PEER_COPY: Setting[str] = Setting(
    "CKPTD_PEER_COPY", _choice("committed", "staged"), "committed",
    "when a step goes to the peers: once committed, or as soon as staged")
AGENT_MEM_RESERVE: Setting[int | None] = Setting(
    "CKPTD_AGENT_MEM_RESERVE", _size, None, "host memory a new segment must leave free "
    "(default 5 %, at least 1 GiB)")
AGENT_SHM_RESERVE: Setting[int | None] = Setting(
    "CKPTD_AGENT_SHM_RESERVE", _size, None, "/dev/shm a new segment must leave free (default a "
    "quarter, at least 512 MiB)")
GRACE_S: Setting[float] = Setting(
    "CKPTD_GRACE_S", _number, 30.0, "the SIGTERM grace window")
AGENT_WRITE_BPS: Setting[float] = Setting(
    "CKPTD_AGENT_WRITE_BPS", _number, 0.0, "the storage's write bandwidth, instead of the "
    "agent's measurement (0: measured)")
AGENT_WRITE_RATE: Setting[float] = Setting(
    "CKPTD_AGENT_WRITE_RATE", _number, 0.0, "bytes/s at most for each save the agent writes "
    "(0: no limit)")
AGENT_NICE: Setting[int] = Setting(
    "CKPTD_AGENT_NICE", _count, 10, "the niceness of the agent's writer threads")
AGENT_RELEASE_S: Setting[float] = Setting(
    "CKPTD_AGENT_RELEASE_S", _number, 60.0, "a root's steps are given back this long after its "
    "last trainer left")

SETTINGS: tuple[Setting[Any], ...] = (
    AGENT, AGENT_DIR, NODE_ID, AGENT_TIMEOUT_S, AGENT_DRAIN_S, AGENT_MIN_BYTES, RUN_ID,
    DEBUG_OVERLAP, DEBUG, JOB_SECRET, AGENT_HOST, PEER_COPIES, PEER_RATE, PEER_COPY,
    AGENT_MEM_RESERVE, AGENT_SHM_RESERVE, GRACE_S, AGENT_WRITE_BPS, AGENT_WRITE_RATE,
    AGENT_NICE, AGENT_RELEASE_S)

# ckptd's own test harness and benchmarks (not read by the library)
_HARNESS = frozenset({"CKPTD_TEST_EXECUTOR", "CKPTD_BENCH_DIR", "CKPTD_CI_BUDGET_S"})


def trainer_only_names() -> frozenset[str]:
    """The ``CKPTD_*`` variables only a training process reads (and the harness's)."""
    return frozenset(s.name for s in SETTINGS if s.trainer_only) | _HARNESS


def env_fields(cls: type[T], prefix: str) -> dict[str, Any]:
    """For each field of the dataclass ``cls`` whose ``<prefix>_<FIELD>`` (upper case) is set,
    that value, parsed by the field's type (``float``, else ``int``); an error naming the
    variable when it does not parse."""
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = f"{prefix}_{field.name.upper()}"
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            changes[field.name] = float(raw) if field.type in ("float", float) else int(raw)
        except ValueError as e:
            kind = "a number" if field.type in ("float", float) else "an integer"
            raise ValueError(f"{name}={raw!r}: expected {kind}") from e
    return changes
