"""Managing a root's committed steps, :class:`StepManagement` (a base of
:class:`ckptd.Checkpointer`): which are there and the newest, what each holds, removing one, the
retention policy, and when to save (``docs/guide.md``, *Managing steps*).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptd import catalog
from ckptd.errors import CheckpointNotFound, CkptdError
from ckptd.manifest import Manifest, layout
from ckptd.policies import Retention, SavePolicy
from ckptd.step_metadata import StepMetadata, step_metadata
from ckptd.storage import Storage
from ckptd.writer.handle import SaveHandle
from ckptd.writer.retention import remove_step


class StepManagement:
    """The committed steps of a Checkpointer's root (its constructor sets the attributes below;
    :class:`ckptd.lifecycle.Lifecycle` gives the rest)."""

    storage: Storage
    url: str
    read_only: bool
    _retention: Retention | None
    _save_policy: SavePolicy | None
    _last_step: int | None

    if TYPE_CHECKING:
        def open(self) -> Any: ...

        def _check_open(self) -> None: ...

        @property
        def inflight(self) -> tuple[SaveHandle, ...]: ...

    # ------------------------------------------------------------------ reading
    def latest_step(self) -> int | None:
        """Newest committed step under the root, in commit order (``docs/format.md``): a newer
        owner's steps win over an older owner's whatever their numbers. Never commits
        anything.

        Returns:
            The step number, or None when there is no committed step.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                assert ckpt.latest_step() is None
                ckpt.save({"w": torch.ones(2)}, step=3)
                assert ckpt.latest_step() == 3
        """
        self.open()
        last = catalog.newest(self.storage)
        return None if last is None else last.step

    def read_manifest(self, step: int) -> Manifest:
        """Advanced: the decoded manifest of committed ``step``, ckptd's own record of the
        format (chunks, files, codecs, attempts; ``docs/format.md``), for tools and tests.
        Its shape follows the format and may change between versions: :meth:`metadata` is
        the stable view.

        Args:
            step: a committed step.

        Returns:
            The step's ``Manifest``.

        Raises:
            CheckpointNotFound: the step is not committed.
            CorruptCheckpoint: its manifest is damaged.
        """
        self.open()
        return catalog.read_manifest(self.storage, step)

    # ------------------------------------------------------------------ managing steps
    def steps(self) -> list[int]:
        """The committed steps under the root, ascending by number. (:meth:`latest_step` is
        the newest in commit order, the last of these unless an older run's steps have
        larger numbers.) Reads the manifests' first bytes only.

        Returns:
            The step numbers, ascending.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp(), keep_last=0) as ckpt:
                for step in (5, 10, 15):
                    ckpt.save({"w": torch.ones(2)}, step=step)
                assert ckpt.steps() == [5, 10, 15]
        """
        return catalog.committed_steps(self.storage)

    def metadata(self, step: int | None = None) -> StepMetadata:
        """What committed ``step`` (default: the latest) holds — tensors, dtypes, global
        shapes, the world that saved it, its ``training=`` metadata, its size — read from its
        manifest alone, no tensor data.

        Args:
            step: a committed step; None: the latest.

        Returns:
            A read-only :class:`~ckptd.StepMetadata`.

        Raises:
            CheckpointNotFound: there is no such step (or none at all).

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                ckpt.save({"model": {"w": torch.zeros(4, 2)}}, step=3, training={"loss": 0.5})
                meta = ckpt.metadata(3)
            assert meta.tensors["model/w"].shape == (4, 2) and meta.world_size == 1
            assert meta.training["loss"] == 0.5
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFound(f"{self.url}: no committed checkpoint")
        return step_metadata(self.storage, int(step))

    def delete(self, step: int) -> bool:
        """Remove committed ``step``; True if this call removed it, False if it was not
        committed (already removed, by retention or another caller, or never saved: not an
        error). The manifest goes first, then the files, as retention removes them: a load
        of the step that is under way either completes or fails with CheckpointNotFound
        ("removed while it was being read"), never with half its data. Refused
        (CkptdError) for a step that a save of this Checkpointer has in flight, and on a
        read-only Checkpointer. Every rank may call it; the first to get there removes it.

        Args:
            step: the step to remove.

        Returns:
            True if this call removed it, False if it was not committed.

        Raises:
            CkptdError: a save of ``step`` is in flight here, or the Checkpointer is
                read-only or closed.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp(), keep_last=0) as ckpt:
                ckpt.save({"w": torch.ones(2)}, step=1)
                ckpt.save({"w": torch.ones(2)}, step=2)
                assert ckpt.delete(1) is True
                assert ckpt.delete(1) is False  # already gone: not an error
                assert ckpt.steps() == [2]
        """
        self._check_open()
        if self.read_only:
            raise CkptdError(f"{self.url}: this Checkpointer is read-only (read_only=True): "
                             f"it does not delete step {step}")
        step = int(step)
        if step in {h.step for h in self.inflight}:
            raise CkptdError(f"{self.url}/{layout.step_dir(step)}: a save of step {step} is in "
                             "flight; wait() for it before deleting the step")
        return remove_step(self.storage, step)

    @property
    def retention(self) -> Retention | None:
        """The retention policy rank 0 applies after each commit (None: every step is
        kept): ``retention=``, or ``KeepLast(keep_last)``."""
        return self._retention

    def should_save(self, step: int) -> bool:
        """Whether to save ``step``, by the ``save_policy`` given (``ckptd.SaveEvery``): call
        it at the same point on every rank (it may be a collective). False for the step this
        Checkpointer last saved or loaded (a resumed loop does not save it again).

        Args:
            step: the step the loop is at.

        Returns:
            Whether to save it.

        Raises:
            CkptdError: the Checkpointer has no ``save_policy``.

        Example:
            import tempfile
            import torch
            import ckptd

            policy = ckptd.SaveEvery(steps=10, on_preemption=False)
            with ckptd.Checkpointer(tempfile.mkdtemp(), save_policy=policy) as ckpt:
                for step in range(1, 31):
                    if ckpt.should_save(step):
                        ckpt.save_async({"w": torch.ones(2)}, step=step)
                ckpt.wait()
                assert ckpt.steps() == [10, 20, 30]
        """
        if self._save_policy is None:
            raise CkptdError("should_save() needs a save policy: Checkpointer(..., "
                             "save_policy=ckptd.SaveEvery(steps=100))")
        due = self._save_policy.should_save(step)
        return due and step != self._last_step

    def _next_step(self, state: Any, step: int | None) -> int:
        if step is not None:
            return int(step)
        given = state.get("step") if isinstance(state, dict) else None
        if isinstance(given, int) and not isinstance(given, bool):
            return given
        if self._last_step is not None:
            return self._last_step + 1
        latest = self.latest_step()
        return 0 if latest is None else latest + 1


__all__ = ["StepManagement"]
