"""How much host memory the node can still give before something is killed for it.

The agent's budget (``--memory-budget``) bounds what the agent holds, but not what the trainers
beside it hold: a node whose trainers keep optimizer state in host memory (ZeRO-Offload) can run
out with the agent well inside its budget, and the kernel's (or the container's) OOM killer picks
the biggest process, a trainer. So before it creates a segment the agent also asks how much
memory is left, and keeps a reserve free (``CKPTD_AGENT_MEM_RESERVE``, default 5 % of the
memory, at least 1 GiB):

* the host: ``MemAvailable`` of ``/proc/meminfo`` (shared memory counts as used: it cannot be
  reclaimed);
* the container, when its memory cgroup has a limit: the limit less the working set, the usage
  without the inactive page cache, which can be reclaimed (what kubelet counts; cgroup v2's
  ``memory.max``, ``memory.current``, ``inactive_file``, or v1's ``memory.limit_in_bytes``,
  ``memory.usage_in_bytes``, ``total_inactive_file``).

The smaller of the two is what is left; ``None`` when neither can be read (not Linux).
"""

from __future__ import annotations

import os

from ckptd import config

GiB = 1 << 30


def _meminfo(path: str) -> dict[str, int]:
    """Fields of a ``/proc/meminfo`` file, in bytes."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            words = rest.split()
            if words and words[0].isdigit():
                out[key] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    return out


# cgroup v2 and v1: the files of the limit, the usage, and the inactive page cache in memory.stat
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_NO_LIMIT = 1 << 62  # v1 writes "no limit" as a number near 2**63


def _cgroup_left(cgroup: str, files: tuple[str, str, str] = _V2) -> tuple[int, int] | None:
    """(limit, left) of the cgroup directory ``cgroup`` (``files``: :data:`_V2` or
    :data:`_V1`); None if it has no limit or cannot be read."""
    limit_f, usage_f, inactive_key = files
    try:
        with open(os.path.join(cgroup, limit_f)) as f:
            raw = f.read().strip()
        if raw == "max" or int(raw) >= _NO_LIMIT:
            return None
        with open(os.path.join(cgroup, usage_f)) as f:
            usage = int(f.read())
        inactive = 0
        with open(os.path.join(cgroup, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
        return int(raw), int(raw) - max(0, usage - inactive)
    except (OSError, ValueError):
        return None


def _own_cgroups(proc: str = "/proc/self/cgroup",
                 mount: str = "/sys/fs/cgroup") -> list[tuple[str, tuple[str, str, str]]]:
    """This process's memory cgroup directories: v2 (``0::/path``) and v1 (``N:memory:/path``,
    under ``mount/memory``), with the files each is read by."""
    out = []
    try:
        with open(proc) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    out.append((os.path.join(mount, path.lstrip("/")), _V2))
                elif "memory" in controllers.split(","):
                    out.append((os.path.join(mount, "memory", path.lstrip("/")), _V1))
    except (OSError, ValueError):
        pass
    return out


def left(meminfo: str = "/proc/meminfo",
         cgroups: list[tuple[str, tuple[str, str, str]]] | None = None) -> tuple[int, int] | None:
    """(total, left) of host memory: the host's or its memory cgroup's (``cgroups``: this
    process's), whichever has less left; None if none is known."""
    found = []
    try:
        info = _meminfo(meminfo)
        found.append((info["MemTotal"], info["MemAvailable"]))
    except (OSError, KeyError):
        pass
    for cgroup, files in _own_cgroups() if cgroups is None else cgroups:
        limited = _cgroup_left(cgroup, files)
        if limited is not None:
            found.append(limited)
    return min(found, key=lambda tl: tl[1]) if found else None


def reserve(total: int) -> int:
    """Bytes of host memory the agent leaves free: ``$CKPTD_AGENT_MEM_RESERVE`` (a size, 0:
    none), else 5 % of ``total``, at least 1 GiB."""
    given = config.AGENT_MEM_RESERVE.get()
    return given if given is not None else max(GiB, total // 20)


def shm_reserve(size: int) -> int:
    """Bytes of the shared-memory filesystem (``/dev/shm``, ``size`` in all) the agent leaves
    free for the training processes' own use of it — a DataLoader's workers hand every batch
    over through it: ``$CKPTD_AGENT_SHM_RESERVE`` (a size, 0: none), else a quarter of it and at
    least 512 MiB (8 workers × a prefetch of 2 × 32 MiB batches), at most all of it. A
    container's default 64 MiB is then all reserve: the agent holds nothing there, and its
    trainers save in process."""
    given = config.AGENT_SHM_RESERVE.get()
    return given if given is not None else min(size, max(size // 4, 512 << 20))


__all__ = ["left", "reserve", "shm_reserve"]
