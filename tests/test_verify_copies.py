"""`ckptd verify` reads each copy of replicated data once (k copies: k + 1 reads, not k^2) and
names the copy that disagrees."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

import ckptd
from ckptd import catalog
from ckptd.loader.verify import verify
from ckptd.manifest import layout as L
from ckptd.storage.local import LocalReadSession, LocalStorage

K = 16  # copies of the middle rows
ROWS, COLS = 2 * K - 1, 256


class Counting(LocalStorage):
    """Counts every byte a read session hands out."""

    read = 0

    def open_read(self, paths: Sequence[str]) -> LocalReadSession:
        session = super().open_read(paths)
        read_into = session.read_into

        def counted(path: str, offset: int, buf: memoryview) -> None:
            self.read += len(buf)
            read_into(path, offset, buf)

        session.read_into = counted  # type: ignore[method-assign]
        return session


def _save(root: str, bad_rank: int | None = None) -> int:
    """K ranks, rank r holding rows [r, r + K): row i is held by up to K ranks."""
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    ranks = [ckptd.Checkpointer(root, rank=r, world_size=K, run_id="k") for r in range(K)]
    hs = []
    for r, c in enumerate(ranks):
        local = full[r : r + K].clone()
        if r == bad_rank:
            local[3, 7] += 1.0  # row r + 3, column 7
        hs.append(c.save_async({"w": ckptd.Shard(local, (ROWS, COLS), (r, 0))}, step=1))
    for h in hs:
        h.result()
    for c in ranks:
        c.close()
    m = catalog.read_manifest(LocalStorage(root), 1)
    return sum(c.length for c in m.tensors["w"].chunks)


def _verify(storage: LocalStorage):
    with ThreadPoolExecutor(2) as pool:
        return verify(storage, L.step_dir(1), catalog.read_manifest(storage, 1), pool)


def test_verify_reads_each_copy_once(tmp_path):
    stored = _save(str(tmp_path))
    assert stored == K * K * COLS * 4  # every copy is on storage
    storage = Counting(str(tmp_path))
    report = _verify(storage)
    assert report.ok, report.problems
    assert report.overlaps_checked == K
    # the checksum pass (each byte once), each copy once, one reference: under 2.2x stored
    assert storage.read <= 2.2 * stored, (storage.read, stored)


def test_verify_names_the_copy_that_disagrees(tmp_path):
    _save(str(tmp_path), bad_rank=5)
    report = _verify(LocalStorage(str(tmp_path)))
    assert len(report.problems) == 1, report.problems
    (problem,) = report.problems
    assert problem.startswith("w: the copy in data/k-000001/r00005-0.bin (rank 5, box [[5, 0], "
                              "[16, 256]]) disagrees with the other copies")
    assert problem.endswith("first difference at element [8, 7]")
