"""Waking a waiter when a name appears in a directory: Linux inotify, for the commit protocol.

The commit protocol's waits poll storage (the coordinator for the ranks' partials, every other
rank for the manifest) with pauses that grow while they wait; a poll that just missed what it
waits for learns it one pause later. Where the kernel can tell, a :class:`Watch` ends the pause
as soon as a name is renamed into a watched directory — on a local filesystem, and
on a shared one for what this node's processes write — so a tiny save costs its fsyncs, not its
pauses. Polling stays the source of truth: the watch only ends a pause early (a change made by
another node of a shared filesystem is not seen: a poll finds it), and where there is no inotify
(another OS, the user's instance limit reached) the pause is a sleep as before.

One inotify instance per process, read by one daemon thread (``ckptd-inotify``, blocked in
``read`` while nothing happens) that counts the events of each watched directory: closing an
instance makes the kernel wait for an RCU grace period, so a wait adds and removes a watch (a
cheap call) on an instance that stays open. A forked child makes its own.

On a local filesystem (ext4, XFS, Btrfs, tmpfs, ...) every change is this node's, so every one
is reported: such a watch is *complete*, and a long wait polls rarely (``ckptd.config``'s
``poll_watched_idle_max_s``). On a shared filesystem a watch sees this node's processes only.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

log = logging.getLogger("ckptd")

# Only renames: every name a wait is for appears by one (LocalStorage.put_atomic and
# put_visible), and an atomic write's temporary file, created first, is not news — nor does
# it wake the reader thread of every waiting process (each rank's partial did, twice)
_IN_MOVED_TO, _IN_IGNORED, _IN_ONLYDIR = 0x80, 0x8000, 0x01000000
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)
# Filesystems whose every change the kernel of this node makes, and so reports (statfs f_type):
# ext2-4, XFS, Btrfs, tmpfs, F2FS, ZFS, overlayfs. On any other (NFS, Lustre, GPFS, CephFS,
# FUSE, SMB, ...) another node's change is not reported: a waiter must keep polling.
_LOCAL_FS = frozenset({0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0xF2F52010, 0x2FC12FC1,
                       0x794C7630})


class Watch(Protocol):
    #: whether every change to the watched directories is reported (a local filesystem), so
    #: that a waiter may poll rarely; False where another node may change them unseen
    complete: bool

    def wait(self, timeout_s: float) -> bool:
        """Block until something appeared in a watched directory since the last call (True) or
        ``timeout_s`` passed (False); :func:`wake_all` ends it too (False)."""
        ...


Key = tuple[int, "str | None"]  # (watch descriptor, a name or None: any name)


class _Notifier:
    """The process's inotify instance and the thread that reads it."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)  # the libc this process already has
        fd = self.libc.inotify_init1(os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        self.fd, self.pid = fd, os.getpid()
        self.cond = threading.Condition()
        self.seen: dict[Key, int] = {}  # events so far of what some wait asked for
        self._refs: dict[Key, int] = {}
        self._wds: dict[int, int] = {}  # references to each watch descriptor
        self.events = 0  # names read so far (tests: what wakes the reader thread)
        threading.Thread(target=self._read, name="ckptd-inotify", daemon=True).start()

    def add(self, dir_fd: int, names: Sequence[str] | None) -> list[Key]:
        # the magic link names the directory this descriptor has open (opened without following
        # links), wherever its path leads now
        path = f"/proc/self/fd/{dir_fd}".encode()
        with self.cond:
            wd = self.libc.inotify_add_watch(self.fd, path, _IN_MOVED_TO | _IN_ONLYDIR)
            if wd < 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            wd = int(wd)  # the same directory: the same wd
            self._wds[wd] = self._wds.get(wd, 0) + 1
            keys: list[Key] = [(wd, n) for n in names] if names is not None else [(wd, None)]
            for k in keys:
                self._refs[k] = self._refs.get(k, 0) + 1
                self.seen.setdefault(k, 0)
            return keys

    def remove(self, keys: list[Key]) -> None:
        with self.cond:
            for k in keys:
                self._refs[k] -= 1
                if self._refs[k] == 0:
                    del self._refs[k], self.seen[k]
            wd = keys[0][0]
            self._wds[wd] -= 1
            if self._wds[wd] == 0:
                del self._wds[wd]
                self.libc.inotify_rm_watch(self.fd, wd)  # gone already (directory removed): -1

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 64 << 10)
            except OSError as e:  # not expected; the waits go on polling
                log.debug("ckptd: inotify read failed (%s); polling only", e)
                return
            woke = False
            at = 0
            with self.cond:
                while at + _HEADER.size <= len(data):
                    wd, mask, _, n = _HEADER.unpack_from(data, at)
                    raw = data[at + _HEADER.size: at + _HEADER.size + n].rstrip(b"\0")
                    at += _HEADER.size + n
                    if mask & _IN_IGNORED:  # a watch removed
                        continue
                    self.events += 1
                    for k in ((wd, None), (wd, raw.decode(errors="replace"))):
                        if k in self.seen:
                            self.seen[k] += 1
                            woke = True
                if woke:
                    self.cond.notify_all()


_lock = threading.Lock()
_notifier: _Notifier | None = None
_failed = False


def _get() -> _Notifier | None:
    global _notifier, _failed
    with _lock:
        if _notifier is not None and _notifier.pid != os.getpid():
            _notifier, _failed = None, False  # a forked child: the parent's thread is not here
        if _notifier is None and not _failed:
            try:
                _notifier = _Notifier()
            except (OSError, AttributeError) as e:  # EMFILE: fs.inotify.max_user_instances
                log.debug("ckptd: no inotify for the commit waits (%s); polling only", e)
                _failed = True
        return _notifier


_woken = 0  # wake_all's count (under each notifier's condition)


def wake_all() -> None:
    """End every wait now (the process began exiting: its waits have a deadline to check)."""
    global _woken
    n = _get_existing()
    if n is None:
        return
    with n.cond:
        _woken += 1
        n.cond.notify_all()


def _get_existing() -> _Notifier | None:
    n = _notifier  # no lock: one read of a reference
    return n if n is not None and n.pid == os.getpid() else None


class _Waiter:
    def __init__(self, notifier: _Notifier, keys: list[Key], complete: bool) -> None:
        self._n, self._keys, self.complete = notifier, keys, complete
        with notifier.cond:
            self._last = self._count()

    def _count(self) -> int:
        return sum(self._n.seen[k] for k in self._keys)

    def wait(self, timeout_s: float) -> bool:
        n = self._n
        with n.cond:
            woken = _woken
            n.cond.wait_for(lambda: self._count() != self._last or _woken != woken,
                            max(timeout_s, 0.0))
            now = self._count()
            changed, self._last = now != self._last, now
        return changed


def _local(libc: ctypes.CDLL, fd: int) -> bool:
    """Whether the filesystem of ``fd`` is one of :data:`_LOCAL_FS` (False if unsure)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field
    if libc.fstatfs(fd, buf) != 0:
        return False
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return f_type in _LOCAL_FS


@contextlib.contextmanager
def watching(dir_fds: Sequence[int], names: Sequence[str] | None = None,
             ) -> Iterator[Watch | None]:
    """A :class:`Watch` of the directories open as ``dir_fds`` (the caller keeps them open
    meanwhile) — woken by any name, or by ``names`` only —, or None where inotify is not
    available."""
    notifier = _get() if dir_fds and sys.platform == "linux" else None
    added: list[list[Key]] = []
    try:
        if notifier is not None:
            try:
                for fd in dir_fds:
                    added.append(notifier.add(fd, names))
            except OSError as e:  # ENOSPC: fs.inotify.max_user_watches
                log.debug("ckptd: no inotify watch for a commit wait (%s); polling only", e)
        complete = (notifier is not None and len(added) == len(dir_fds)
                    and all(_local(notifier.libc, fd) for fd in dir_fds))
        keys = [k for ks in added for k in ks]
        yield _Waiter(notifier, keys, complete) if notifier is not None and added else None
    finally:
        for ks in added:
            assert notifier is not None
            notifier.remove(ks)


def no_watch() -> contextlib.AbstractContextManager[Watch | None]:
    return contextlib.nullcontext(None)


__all__ = ["Watch", "no_watch", "wake_all", "watching"]
