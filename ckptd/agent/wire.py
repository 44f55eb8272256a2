"""Where a node's agent listens, who it serves, and how its clients talk to it.

One directory per user (``$CKPTD_AGENT_DIR``, else ``<tmp>/ckptd-<uid>``), owner-only and not a
link: it holds ``agent-<node>-<env>.sock`` (the socket), ``.lock`` (held by the running agent)
and ``.log``. The node is ``$CKPTD_NODE_ID`` (set by the launcher; several simulated nodes share
one machine in the tests and the demo), else the host name. ``<env>`` is a digest of the
environment a save depends on (:func:`environment`: storage credentials and configuration,
proxies and certificates, the ``CKPTD_*`` settings the agent reads): the agent writes with the
environment it was started with, so a trainer only ever talks to an agent whose environment is
its own — a job with other credentials, another job secret or other settings gets an agent of
its own, never a save that fails, or succeeds, with another job's.

Messages are JSON objects, each preceded by its length (4 bytes, big-endian). Every request
carries an ``id`` that its reply repeats; the agent also sends ``{"op": "alive"}`` every
:data:`HEARTBEAT_S` so that a client notices an agent that stopped answering. The ``hello``
reply carries the agent's :func:`identity` (package version and a digest of its code): a
trainer of other code saves in process (``docs/agent.md``, *An agent of another version*).
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from ckptd import config
from ckptd.errors import CkptdError

HEARTBEAT_S = 0.5
MAX_MESSAGE = 256 << 20
_HEADER = struct.Struct(">I")


class Refused(CkptdError, PermissionError):
    """The agent (or its directory) is not this user's."""


class SocketPathTooLong(CkptdError, ValueError):
    """An agent socket's path that no Unix socket address can hold, even through its
    directory (:func:`socket_address`)."""


# The most bytes of a path a Unix socket address holds (sun_path, with its NUL: 108 on Linux,
# 104 on the BSDs and macOS).
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103


def _too_long(path: str) -> bool:
    return len(os.fsencode(path)) > SOCKET_PATH_MAX


def too_long_note(path: str) -> str:
    """What :func:`socket_address` does with ``path``, for a log line ("" when nothing)."""
    if not _too_long(path):
        return ""
    return (f" ({len(os.fsencode(path))} bytes, over the {SOCKET_PATH_MAX}-byte limit of a "
            "socket address: reached through its directory's descriptor)")


@contextlib.contextmanager
def socket_address(path: str) -> Iterator[str]:
    """``path`` as the address to bind or connect a Unix socket to, for the block: itself when
    it fits (:data:`SOCKET_PATH_MAX`), else ``/proc/self/fd/<n>/<name>`` through a descriptor
    ``n`` of its directory, open for the block — the kernel resolves it to the same file, in
    the same private directory, and unlike a ``chdir`` it changes nothing the process's other
    threads see. A deep ``$CKPTD_AGENT_DIR`` or ``$TMPDIR`` thus costs nothing.

    Raises:
        SocketPathTooLong: not even that fits, or ``/proc`` does not reach the directory (no
            ``/proc``, another PID namespace's, not Linux): names the path, its length and
            the setting to change.
        OSError: the directory cannot be opened (it does not exist: no agent there).
    """
    if not _too_long(path):
        yield path
        return
    size = f"{path}: a Unix socket path of {len(os.fsencode(path))} bytes, over the " \
           f"{SOCKET_PATH_MAX}-byte limit of a socket address"
    remedy = f"set {config.AGENT_DIR.name} to a shorter directory"
    if not hasattr(os, "O_PATH"):
        raise SocketPathTooLong(f"{size}: {remedy}")
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        short = f"/proc/self/fd/{fd}/{os.path.basename(path)}"
        if _too_long(short):
            raise SocketPathTooLong(f"{size} even when reached through its directory: {remedy}")
        try:
            seen, opened = os.stat(os.path.dirname(short)), os.fstat(fd)
            same = (seen.st_dev, seen.st_ino) == (opened.st_dev, opened.st_ino)
        except OSError:
            same = False
        if not same:
            raise SocketPathTooLong(f"{size}, and /proc/self/fd does not reach its directory "
                                    f"(is /proc mounted?): {remedy}")
        yield short
    finally:
        os.close(fd)


def check_root(url: Any) -> None:
    """Refuse a root the agent would resolve differently from its trainer: a relative path
    means the agent's working directory here, not the trainer's (trainers send their root
    resolved: :attr:`ckptd.storage.Storage.url`)."""
    if not isinstance(url, str) or not url:
        raise CkptdError(f"a save's storage has no root URL: {url!r}")
    path = url[len("file://"):] if url.startswith("file://") else None if "://" in url else url
    if path is not None and not os.path.isabs(path):
        raise CkptdError(f"{url!r} is a relative root: the node agent would resolve it in its "
                         "own working directory, not the trainer's")


def root_key(spec: Mapping[str, Any]) -> str:
    """The key of a root by its storage spec (URL and options) as trainers send it: the spec's
    canonical JSON, the same for the same spec from any trainer."""
    return json.dumps(spec, sort_keys=True)


# What a save depends on besides its job: the storage's credentials and configuration (boto,
# s3fs, fsspec, Google and Azure clients, ~/.aws under HOME), the network's proxies and
# certificates, and ckptd's own settings — but for those only a trainer reads, or that name the
# agent already (its node and directory): ``config.trainer_only_names()``.
_ENV_PREFIXES = ("AWS_", "BOTO", "S3FS_", "FSSPEC_", "GOOGLE_", "GCSFS_", "CLOUDSDK_", "AZURE_",
                 "ADLFS_", "CKPTD_")
_ENV_NAMES = frozenset({"HOME", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
                        "http_proxy", "https_proxy", "no_proxy", "all_proxy", "SSL_CERT_FILE",
                        "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"})
def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of ``env`` (default: this process's) that an agent's saves depend on."""
    source: Mapping[str, str] = os.environ if env is None else env
    skip = config.trainer_only_names()
    return {k: v for k, v in sorted(source.items())
            if (k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)) and k not in skip}


def env_key(env: dict[str, str] | None = None) -> str:
    """A short digest of :func:`environment` (a one-way hash: it names files, and may cover
    credentials)."""
    doc = json.dumps(environment(env), sort_keys=True).encode()
    return hashlib.sha256(doc).hexdigest()[:12]


@functools.cache
def identity() -> dict[str, str]:
    """This ckptd's package version and a digest of its code (every module of the package): an
    agent runs the code it was started with, so a trainer of another install, or of a patched
    copy, must not hand it its saves."""
    from ckptd._version import __version__

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ckptd/
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, package).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    return {"version": __version__, "code": digest.hexdigest()[:16]}


class RateLog:
    """At most one log line per key (a peer's address, a kind of error) every ``every_s``
    seconds; the lines held back are counted in the next one."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0, keys: int = 1024) -> None:
        self.log, self.every_s, self.keys = logger, every_s, keys
        self._last: dict[str, tuple[float, int]] = {}  # key -> (time said, held back since)
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            said, held = self._last.get(key, (-self.every_s, 0))
            if now - said < self.every_s:
                self._last[key] = (said, held + 1)
                return
            if len(self._last) >= self.keys:  # a flood from many addresses: forget the oldest
                for k in sorted(self._last, key=lambda k: self._last[k][0])[: self.keys // 2]:
                    del self._last[k]
            self._last[key] = (now, 0)
        more = f" ({held} more like it in the last {self.every_s:.0f} s)" if held else ""
        self.log.warning(msg + more, *args)


def request(path: str, msg: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """One request to the agent listening at ``path`` and its reply, without a session's
    ``hello`` (``ckptd agent --status`` and ``--stop``: no torch to import). OSError if it
    does not answer; :class:`Refused` if it is another user's; :class:`SocketPathTooLong` if
    ``path`` cannot be reached (:func:`socket_address`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        with socket_address(path) as address:
            sock.connect(address)
        uid, _ = peer_uid_pid(sock)
        if uid != os.getuid():
            raise Refused(f"{path}: the agent there is of uid {uid}, not {os.getuid()}")
        send(sock, {**msg, "id": 1})
        while True:
            reply = recv(sock)
            if reply.get("id") == 1:  # (heartbeats come between)
                return reply


def failure(rid: Any, error: BaseException) -> dict[str, Any]:
    """The reply that reports ``error`` (a request's or a save's): its class's name, message and
    errno, from which :func:`error_of` rebuilds the same error on the other side."""
    return {"id": rid, "op": "failed", "error": str(error), "kind": type(error).__name__,
            "errno": getattr(error, "errno", None)}


def error_of(reply: dict[str, Any]) -> CkptdError | OSError:
    """The error a ``failed`` reply reports, as the class it was raised as when that is one of
    ckptd's documented errors (``ckptd.errors``: StorageError, ForeignWriter,
    CorruptCheckpoint, ...) or a built-in OSError (with its errno): code that catches them by
    class works the same with the agent as without. Any other becomes a CkptdError naming the
    class."""
    from ckptd import errors

    kind, message = str(reply.get("kind")), str(reply.get("error"))
    documented = getattr(errors, kind, None)
    builtin = getattr(builtins, kind, None)
    err: CkptdError | OSError
    if isinstance(documented, type) and issubclass(documented, CkptdError):
        err = documented(message)
    elif isinstance(builtin, type) and issubclass(builtin, OSError):
        err = builtin(message)
    else:
        err = CkptdError(f"{kind}: {message}")
    number = reply.get("errno")
    if isinstance(err, OSError) and isinstance(number, int):
        err.errno = number
    return err


def node_id() -> str:
    raw = config.NODE_ID.get() or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)[:64] or "node"


def default_dir() -> str:
    """``$CKPTD_AGENT_DIR``, else ``<tmp>/ckptd-<uid>``."""
    return config.AGENT_DIR.get() or os.path.join(tempfile.gettempdir(),
                                                             f"ckptd-{os.getuid()}")


def check_dir(d: str) -> str:
    """``d`` if it is a private directory of this user; :class:`Refused` if it is a link
    (another user's link in the shared ``<tmp>`` would put the socket, the lock and the log
    where that user chose), not a directory, another user's, or open to others."""
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{d}: the agent directory must be a directory of uid {os.getuid()}, "
                      "not a link or a file")
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise Refused(f"{d}: the agent directory must be owned by uid {os.getuid()} and "
                      f"private (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid})")
    return d


def agent_dir(create: bool = True) -> str:
    """The per-user directory (:func:`default_dir`), created if missing and ``create``, and
    checked (:func:`check_dir`)."""
    d = default_dir()
    if create and not os.path.lexists(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
    return check_dir(d)


def instance(node: str, env: dict[str, str] | None = None) -> str:
    """The agent's name on its node: the node and :func:`env_key`."""
    return f"{node}-{env_key(env)}"


def paths(node: str, directory: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The socket, lock and log of the agent of ``node`` for the environment ``env`` (default:
    this process's)."""
    base = os.path.join(directory, f"agent-{instance(node, env)}")
    return {"sock": base + ".sock", "lock": base + ".lock", "log": base + ".log"}


def node_agents(node: str, directory: str) -> list[dict[str, str]]:
    """Every agent of ``node`` in ``directory``, whatever its environment (its lock, socket
    and log; running or not)."""
    mine = re.compile(rf"agent-{re.escape(node)}-[0-9a-f]{{12}}\.lock")
    out = []
    for name in sorted(os.listdir(directory)):
        if mine.fullmatch(name):
            base = os.path.join(directory, name[: -len(".lock")])
            out.append({"sock": base + ".sock", "lock": base + ".lock", "log": base + ".log"})
    return out


def lock_pid(path: str) -> int | None:
    """The pid in an agent's lock file, if the lock is held (its agent runs)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 32).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None  # nobody holds it
    finally:
        os.close(fd)


def take_lock(path: str) -> int | None:
    """The node's agent lock (held for the agent's life), or None if another agent holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def peer_uid_pid(sock: socket.socket) -> tuple[int, int]:
    """The uid and pid of the process at the other end of a Unix socket (from the kernel)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return uid, pid


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError("the other end closed the connection")
        out += part
    return bytes(out)


def nesting(data: bytes) -> int:
    """How deep JSON text nests arrays and objects (strings skipped), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def recv(sock: socket.socket, limit: int = MAX_MESSAGE,
         max_depth: int | None = None) -> dict[str, Any]:
    """One message; ``ConnectionError`` if it is over ``limit`` bytes, nests deeper than
    ``max_depth`` (what an unauthenticated peer sends is checked before it is parsed: a deep
    document would exhaust the parser's recursion), or is not a JSON object."""
    (n,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    if n > limit:
        raise ConnectionError(f"a message of {n} bytes is over the {limit}-byte limit")
    data = _exactly(sock, n)
    if max_depth is not None and nesting(data) > max_depth:
        raise ConnectionError(f"a message nested deeper than {max_depth} levels")
    msg = json.loads(data)
    if not isinstance(msg, dict):
        raise ConnectionError("a message that is not a JSON object")
    return msg


__all__ = ["HEARTBEAT_S", "SOCKET_PATH_MAX", "RateLog", "Refused", "SocketPathTooLong",
           "agent_dir", "check_dir", "check_root", "default_dir", "env_key", "environment",
           "error_of", "failure", "identity", "instance", "lock_pid", "nesting", "node_agents",
           "node_id", "paths", "peer_uid_pid", "recv", "request", "root_key", "send",
           "socket_address", "take_lock", "too_long_note"]
