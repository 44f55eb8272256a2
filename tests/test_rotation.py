"""A reader racing retention: a step rotated away under a load is not a corrupt checkpoint."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import ckptd
from ckptd.errors import CheckpointNotFound
from ckptd.storage.local import LocalStorage
from ckptd.writer import retention


class RotateOnFirstRead(LocalStorage):
    """A reader's storage: just before the first data file of a load is opened, the training job
    (another Checkpointer on the same root, with keep_last=1) commits a newer step and its retention
    removes the step being read — the race an evaluation job polling `latest` runs into."""

    def __init__(self, root: str, writer: ckptd.Checkpointer, value: float) -> None:
        super().__init__(root)
        self.writer, self.value, self.fired = writer, value, False

    def _rotate(self) -> None:
        if not self.fired:
            self.fired = True
            step = self.writer.latest_step() + 1
            self.writer.save({"w": torch.full((1 << 12,), self.value)}, step=step)
            # the training job's retention (keep_last=1), run to completion now
            retention.apply_retention(LocalStorage(self.root), 1)

    def open_read(self, paths: Sequence[str]):  # type: ignore[no-untyped-def]
        if not any(p.endswith("/manifest.json") for p in paths):  # a load holds it open too
            self._rotate()
        return super().open_read(paths)

    def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
        self._rotate()
        return super().read_ranges(path, ranges)


def _setup(tmp_path):
    root = str(tmp_path)
    # keep_last=0: the rotation is the one RotateOnFirstRead runs, to completion, at a known point
    writer = ckptd.Checkpointer(root, run_id="train", keep_last=0)
    writer.save({"w": torch.full((1 << 12,), 1.0)}, step=1)
    return root, writer


def test_loading_the_latest_retries_once_when_retention_removed_it_meanwhile(tmp_path):
    root, writer = _setup(tmp_path)
    storage = RotateOnFirstRead(root, writer, 2.0)
    dst = {"w": torch.zeros(1 << 12)}
    with ckptd.Checkpointer(root, storage=storage, read_only=True) as reader:
        result = reader.load(dst)
    assert storage.fired and result.step == 2
    assert torch.equal(dst["w"], torch.full((1 << 12,), 2.0))
    writer.close()


def test_loading_a_named_step_that_retention_removed_meanwhile_says_so(tmp_path):
    root, writer = _setup(tmp_path)
    storage = RotateOnFirstRead(root, writer, 2.0)
    dst = {"w": torch.zeros(1 << 12)}
    with ckptd.Checkpointer(root, storage=storage, read_only=True) as reader:
        with pytest.raises(CheckpointNotFound, match=r"step-000000001: removed while it was "
                                                     r"being read \(deleted, or rotated away "
                                                     r"by retention"):
            reader.load(dst, step=1)
    assert torch.equal(dst["w"], torch.zeros(1 << 12))
    writer.close()
