"""Which checkpoint a load reads: a named step, the newest committed step, or another source
through a plug-in; and what a step rotated away by retention under a reader means.

Retention and ``Checkpointer.delete`` uncommit a step (remove its ``manifest.json``) before
they delete its files, so a reader that finds a data file missing and then the manifest gone
knows the step was removed, not damaged: loading the newest step retries once; loading a named
step says so (:class:`~ckptd.errors.CheckpointNotFound`), never "corrupt".
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptd import catalog, gcpause
from ckptd.errors import CheckpointNotFound, CkptdError, CorruptCheckpoint
from ckptd.loader.load import Strict, load_into
from ckptd.manifest import Manifest, layout
from ckptd.sharding import Described
from ckptd.storage import Storage
from ckptd.world import from_rank0, shared_from_rank0

log = logging.getLogger("ckptd")

SOURCE_PLUGINS = "ckptd.sources"  # entry-point group of the load(source=...) readers


@dataclass(frozen=True)
class LoadResult:
    """What a load filled the state from (``Checkpointer.load``, ``ckptd.load``).

    Attributes:
        step: the step loaded.
        url: its directory (``ROOT/step-NNNNNNNNN``).
        nbytes_read: bytes this rank read (stored size).
        training: the step's ``training=`` metadata (JSON values; empty if none).
        tensors_decoded: logical tensors whose chunk entries this rank decoded from the
            manifest (format 3; 0 for older checkpoints).
        frames_read: manifest frames this rank read.
        nbytes_from_memory: of ``nbytes_read``, what this node's agent served from memory
            (this node's own files).
        nbytes_from_peer: of ``nbytes_read``, what other nodes' files memory served.

    Example:
        import tempfile
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ckpt.save({"w": torch.ones(8)}, step=4, training={"epoch": 2})
            result = ckpt.load({"w": torch.zeros(8)})
        assert (result.step, result.training) == (4, {"epoch": 2})
        assert result.nbytes_read == result.nbytes_from_storage + result.nbytes_from_memory \
            + result.nbytes_from_peer
    """

    step: int
    url: str
    nbytes_read: int
    training: dict[str, Any]
    # the manifest's metadata this rank decoded (format 3): tensors whose chunks it parsed,
    # frames it read from the frame tables
    tensors_decoded: int = 0
    frames_read: int = 0
    # of nbytes_read, the bytes the node agent's memory served (docs/agent.md): this node's
    # own files, and the peer copies it holds of other nodes' files; the rest came from storage
    nbytes_from_memory: int = 0
    nbytes_from_peer: int = 0

    @property
    def nbytes_from_storage(self) -> int:
        """Of ``nbytes_read``, the bytes the storage served (not the node agents' memory)."""
        return self.nbytes_read - self.nbytes_from_memory - self.nbytes_from_peer


@dataclass(frozen=True)
class Reader:
    """One rank's view of a root for loading."""

    storage: Storage
    rank: int
    world_size: int
    pool: ThreadPoolExecutor  # the I/O threads

    def load_step(self, described: Described, step: int, strict: Strict) -> LoadResult:
        # the decoded manifest's objects: see ckptd/gcpause.py
        with gcpause.paused(), catalog.ManifestFile(self.storage, step) as file:
            cpu0 = time.thread_time()
            manifest = self.read_manifest(step, file)
            nbytes = load_into(self.storage, layout.step_dir(step), manifest, described,
                               rank=self.rank, world_size=self.world_size, strict=strict,
                               pool=self.pool, metadata_since=cpu0)
            url = f"{self.storage.url}/{layout.step_dir(step)}"
            frames = manifest.frames.fetched_frames if manifest.frames is not None else 0
            result = LoadResult(step, url, nbytes, dict(manifest.training),
                                tensors_decoded=len(manifest.decoded), frames_read=frames)
            del manifest  # freed by reference counts, before the collector is back
        return result

    def read_manifest(self, step: int, file: catalog.ManifestFile) -> Manifest:
        """``step``'s manifest, decoded. With a process group, rank 0 alone reads its head
        from storage and one broadcast gives it to the other ranks (a restart of a thousand
        ranks reads it once, not a thousand times); a failure there (the file missing,
        unreadable) is raised on every rank alike. Every rank checks the head digest of the
        bytes it holds as it decodes them, then reads from ``file`` the entries of the tensors
        it loads, each checked against its digest (format 5; an older manifest is read whole
        by rank 0 and its file digest checked on every rank)."""
        raw = shared_from_rank0(file.head)
        return catalog.decode_manifest(self.storage, step, raw, file)

    def load_named(self, described: Described, step: int, strict: Strict) -> LoadResult:
        try:
            return self.load_step(described, step, strict)
        except CorruptCheckpoint as e:  # its manifest was read: was it removed since?
            if self.rotated_away(step):
                raise CheckpointNotFound(
                    f"{self.storage.url}/{layout.step_dir(step)}: removed while it was being read "
                    "(deleted, or rotated away by retention: load another step)"
                ) from e
            raise

    def load_newest(self, described: Described, strict: Strict) -> LoadResult:
        """The newest committed step in commit order (rank 0 looks, every rank loads the same
        step), retried once when retention removed it while it was being read."""
        for last_try in (False, True):
            step = from_rank0(self.newest)
            if step is None:
                raise CheckpointNotFound(f"{self.storage.url}: no committed checkpoint")
            try:
                return self.load_step(described, step, strict)
            except (CorruptCheckpoint, CheckpointNotFound):
                if last_try or not self.rotated_away(step):
                    raise
                log.warning("ckptd: step %d was removed by retention while being read; "
                            "loading the newest step", step)
        raise AssertionError("unreachable")

    def newest(self) -> int | None:
        """The newest committed step in commit order (``docs/format.md``), None if none."""
        last = catalog.newest(self.storage)
        return None if last is None else last.step

    def rotated_away(self, step: int) -> bool:
        """Whether ``step`` stopped being committed."""
        try:
            return not self.storage.exists(layout.manifest_path(step))
        except OSError:
            return False

    def load_source(self, state: Any, source: str | None, step: int | None, strict: Strict,
                    trust: bool) -> LoadResult | None:
        """Ask the installed source plug-ins (entry points in the ``ckptd.sources`` group;
        ckptd's own reads torch.distributed.checkpoint directories) to load ``source``, or the
        root when it is not a ckptd root. None: a ckptd root, load it as one."""
        from importlib.metadata import entry_points

        plugins = sorted(entry_points(group=SOURCE_PLUGINS), key=lambda e: e.name)
        for plugin in plugins:
            result = plugin.load()(self.storage, state, source=source, step=step,
                                   strict=strict, trust=trust, rank=self.rank,
                                   world_size=self.world_size,
                                   threads=self.pool._max_workers)  # typeshed declares it
            if result is not None:
                return result  # type: ignore[no-any-return]
        if source is not None:
            names = ", ".join(e.name for e in plugins) or "none is installed"
            raise CkptdError(f"{source}: no source plug-in can read it (plug-ins: {names})")
        return None
