"""Where a node's agent listens, and how its clients talk to it.

One directory per user (``$CKPTD_AGENT_DIR``, else ``<tmp>/ckptd-<uid>``), owner-only: it holds
``agent-<node>.sock`` (the socket), ``.lock`` (held by the running agent) and ``.log``. The node
is ``$CKPTD_NODE_ID`` (set by the launcher; several simulated nodes share one machine in the
tests and the demo), else the host name.

Messages are JSON objects, each preceded by its length (4 bytes, big-endian). Every request
carries an ``id`` that its reply repeats; the agent also sends ``{"op": "alive"}`` every
:data:`HEARTBEAT_S` so that a client notices an agent that stopped answering.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import stat
import struct
import tempfile
from typing import Any

from ckptd.errors import CkptdError

HEARTBEAT_S = 0.5
MAX_MESSAGE = 256 << 20
_HEADER = struct.Struct(">I")


class Refused(CkptdError, PermissionError):
    """The agent (or its directory) is not this user's."""


def node_id() -> str:
    raw = os.environ.get("CKPTD_NODE_ID") or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)[:64] or "node"


def agent_dir(create: bool = True) -> str:
    """The per-user directory; refused if another user owns it or others may enter it."""
    d = os.environ.get("CKPTD_AGENT_DIR") or os.path.join(tempfile.gettempdir(),
                                                          f"ckptd-{os.getuid()}")
    if create:
        os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise Refused(f"{d}: the agent directory must be owned by uid {os.getuid()} and "
                      f"private (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid})")
    return d


def paths(node: str, directory: str) -> dict[str, str]:
    base = os.path.join(directory, f"agent-{node}")
    return {"sock": base + ".sock", "lock": base + ".lock", "log": base + ".log"}


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


def recv(sock: socket.socket, limit: int = MAX_MESSAGE) -> dict[str, Any]:
    (n,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    if n > limit:
        raise ConnectionError(f"a message of {n} bytes is over the {limit}-byte limit")
    msg = json.loads(_exactly(sock, n))
    if not isinstance(msg, dict):
        raise ConnectionError("a message that is not a JSON object")
    return msg


__all__ = ["HEARTBEAT_S", "Refused", "agent_dir", "node_id", "paths", "peer_uid_pid", "recv",
           "send", "take_lock"]
