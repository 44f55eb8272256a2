"""Staging memory shared by the trainer and its node agent.

The agent creates each segment (``/dev/shm``, owner-only, ``O_EXCL``) and backs it with real
pages (``posix_fallocate``: a full ``/dev/shm`` is an error here, not a SIGBUS in the middle of a
copy). The name stays while the segment is a trainer's arena or the memory tier's copy of a step
(a loader maps it by name) and is removed by the agent after that — or, if the agent was killed,
by the next agent of the node at start-up. Each side keeps its own mapping for as long as it
needs the bytes: the agent until the files are written, the trainer until its save is committed
(it writes the same memory itself if the agent is lost).
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat

import torch

from ckptd.errors import StorageError

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


class Segment:
    """One mapping of a shared-memory file; ``tensor`` is a uint8 view of all of it."""

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap) -> None:
        self.path, self.nbytes, self._mm = path, nbytes, mm
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        self.cuda_registered = False

    def register_with_cuda(self) -> str | None:
        """Page-lock this mapping for CUDA (``cudaHostRegister``, portable to every device's
        context), so that device-to-host copies into it are asynchronous DMA, as into the
        in-process arenas' pinned memory; without it they are synchronous and bounced through
        the driver's own buffers. Call it once CUDA is initialised on the trainer's device (it
        would otherwise create a context on device 0). None once registered, else why not (the
        copies then still work, slower). Not run on this project's CPU-only machines."""
        if self.cuda_registered:
            return None
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = int(cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes,
                                          _CUDA_HOST_REGISTER_PORTABLE))
        if err:
            return f"cudaHostRegister of {self.nbytes} bytes at {self.path} failed: cudaError {err}"
        self.cuda_registered = True
        return None

    def unregister_from_cuda(self) -> None:
        """Before the mapping goes (a registered range must not be unmapped)."""
        if self.cuda_registered:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self.tensor.data_ptr())
            self.cuda_registered = False

    def view(self) -> memoryview:
        """The whole segment as bytes."""
        return memoryview(self._mm)

    @classmethod
    def create(cls, nbytes: int, tag: str) -> Segment:
        path = os.path.join(_root(), f"ckptd-{os.getuid()}-{tag}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                os.unlink(path)
                raise StorageError(f"{path}: cannot reserve {nbytes} bytes of shared memory: "
                                   f"{e.strerror}") from e
            return cls(path, nbytes, mmap.mmap(fd, nbytes))
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> Segment:
        """Map a segment the agent created (its name is the agent's to remove)."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size < nbytes:
                raise StorageError(f"{path}: not a private shared-memory segment of "
                                   f"{nbytes} bytes")
            return cls(path, nbytes, mmap.mmap(fd, nbytes))
        finally:
            os.close(fd)


def map_readonly(path: str) -> memoryview:
    """A read-only mapping of a kept segment (its name stays: the agent owns it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise StorageError(f"{path}: not a private shared-memory segment")
        if not st.st_size:
            return memoryview(b"")
        return memoryview(mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def shm_free() -> int:
    """Free bytes where segments are created."""
    return shm_space()[1]


def shm_space() -> tuple[int, int]:
    """The size and the free bytes of the filesystem where segments are created."""
    st = os.statvfs(_root())
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def stale_segments(instance: str) -> tuple[list[str], list[str]]:
    """The segments a killed agent named ``instance`` (:func:`ckptd.agent.wire.instance`) left
    (names ``ckptd-<uid>-<instance>+...``), and the names of that form this user does not own
    (planted by another user in the shared ``/dev/shm``; not removable, and never reused:
    every agent's names carry a random part of its own)."""
    prefix = f"ckptd-{os.getuid()}-{instance}+"
    root = _root()
    ours: list[str] = []
    foreign: list[str] = []
    for name in os.listdir(root):
        if not name.startswith(prefix):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        mine = st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode)
        (ours if mine else foreign).append(path)
    return ours, foreign


def remove_stale(instance: str) -> list[str]:
    """Remove the segments a killed agent named ``instance`` left; the names of that form that
    could not be removed, or are not this user's (planted in the shared ``/dev/shm`` by
    another: skipped — this agent's own names have a random part of their own and never meet
    them)."""
    stale, skipped = stale_segments(instance)
    for path in stale:
        try:
            unlink(path)
        except OSError:
            skipped.append(path)
    return skipped


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["Segment", "map_readonly", "remove_stale", "shm_free", "shm_space", "stale_segments",
           "unlink"]
