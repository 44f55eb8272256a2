"""The commit protocol: attempts, stragglers, foreign jobs, holes, finalisation, failures."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch
from faulty_storage import FailAfterBytes

import ckptd
from ckptd import config
from ckptd.errors import ForeignWriter, StorageError
from ckptd.manifest import layout as L
from ckptd.manifest.envelope import open_doc


def _sim(url, world, run_id="job", **kw):
    return [
        ckptd.Checkpointer(url, rank=r, world_size=world, run_id=run_id, **kw) for r in range(world)
    ]


def _uncommitted(root, state):  # type: ignore[no-untyped-def]
    """``state`` saved as step 1 on two simulated ranks, then uncommitted (its manifest
    removed): the Checkpointers, their storage and the path of rank 1's partial."""
    cs = _sim(root, 2)
    for h in [c.save_async(state, step=1) for c in cs]:
        h.result()
    storage = cs[0].storage
    attempt = cs[0].read_manifest(1).attempt
    storage.remove(L.manifest_path(1))
    return cs, storage, L.partial_path(1, attempt, 1)


def test_a_straggler_of_an_earlier_world_is_never_merged(tmp_path):
    url = str(tmp_path)
    # An old world of 2 ranks: only its rank 1 still runs and writes a partial for step 5.
    old = ckptd.Checkpointer(url, rank=1, world_size=2, run_id="old-world")
    with config.override(commit_timeout_s=0.2):
        straggler = old.save_async({"w": ckptd.Shard(torch.full((2,), 666.0), (4,), (2,))}, step=5)
        # The new world (2 ranks) saves the same step under its own attempt.
        new = _sim(url, 2, run_id="new-world")
        hs = [
            c.save_async({"w": ckptd.Shard(torch.full((2,), float(r)), (4,), (2 * r,))}, step=5)
            for r, c in enumerate(new)
        ]
        for h in hs:
            h.result()
        with pytest.raises(ckptd.CkptdError, match="not committed|no commit"):
            straggler.result()
    dst = {"w": torch.zeros(4)}
    new[0].load(dst, step=5)
    assert torch.equal(dst["w"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    for c in new:
        c.close()
    old.close()  # the straggler's error was already raised once, by result()


def test_two_jobs_on_one_root_fail_loudly(tmp_path):
    url = str(tmp_path)
    first = ckptd.Checkpointer(url, run_id="job-a")
    first.save({"w": torch.ones(3)}, step=1)
    second = ckptd.Checkpointer(url, run_id="job-b").open()  # takes the root over
    with pytest.raises(ForeignWriter, match="owned by run job-b.*another job"):
        first.save({"w": torch.zeros(3)}, step=2)
    second.save({"w": torch.full((3,), 2.0)}, step=2)
    dst = {"w": torch.zeros(3)}
    second.load(dst)
    assert torch.equal(dst["w"], torch.full((3,), 2.0))
    first.close()
    second.close()


def test_a_read_only_reader_does_not_take_the_root_from_the_job_that_writes_it(tmp_path):
    url = str(tmp_path)
    with ckptd.Checkpointer(url, run_id="training") as job:
        job.save({"w": torch.ones(3)}, step=1)
        with ckptd.Checkpointer(url, run_id="eval", read_only=True) as reader:  # an eval job
            dst = {"w": torch.zeros(3)}
            assert reader.load(dst).step == 1 and torch.equal(dst["w"], torch.ones(3))
            with pytest.raises(ckptd.CkptdError, match="read-only"):
                reader.save({"w": torch.ones(3)}, step=2)
        job.save({"w": torch.full((3,), 2.0)}, step=2)  # still the owner: commits
        assert job.latest_step() == 2


def test_a_hole_in_coverage_fails_the_save_naming_the_tensor(tmp_path):
    cs = _sim(str(tmp_path), 2)
    hs = [
        c.save_async({"w": ckptd.Shard(torch.ones(3, 4), (8, 4), (r * 3, 0))}, step=1)
        for r, c in enumerate(cs)
    ]
    for h in hs:  # every rank raises the coordinator's error, with its class
        with pytest.raises(
            ckptd.StateMismatch,
            match=r"w: elements at offsets \[6, 0\] sizes "
            r"\[2, 4\] of shape \[8, 4\]",
        ):
            h.result()
    assert not os.path.exists(tmp_path / L.manifest_path(1))
    for c in cs:
        c.close()


def test_replicated_pieces_are_written_once_spread_across_replicas(tmp_path):
    cs = _sim(str(tmp_path), 4)
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(16)}
    hs = [c.save_async(state, step=1) for c in cs]
    for h in hs:
        h.result()
    m = cs[0].read_manifest(1)
    assert all(len(e.chunks) == 1 for e in m.tensors.values())
    writers = {e.chunks[0].rank for e in m.tensors.values()}
    assert len(writers) >= 3  # 16 tensors hashed over 4 replicas
    for c in cs:
        c.close()


def test_a_partial_names_only_what_its_rank_wrote_not_what_a_replica_wrote(tmp_path):
    """Partials grow with a rank's writes, not with the state: the tensors a rank holds but a
    replica wrote appear in its partial as one replica set (a count and a digest), never by
    name, so the coordinator's input is O(chunks + ranks), not ranks x tensors. Every tensor
    held is still checked to be written (the step commits)."""
    from ckptd.manifest.parse import decode

    cs = _sim(str(tmp_path), 4)
    state = {f"layers/{i:04d}/a_long_parameter_name/weight": torch.full((10,), float(i))
             for i in range(64)}
    for h in [c.save_async(state, step=1) for c in cs]:
        h.result()
    m = cs[0].read_manifest(1)
    wrote = {r: {n for n, e in m.tensors.items() if e.chunks[0].rank == r} for r in range(4)}
    d = tmp_path / L.partials_dir(1, m.attempt)
    for r in range(4):
        raw = (d / f"{r:05d}.json").read_bytes()
        partial = decode(raw, "partial")
        assert set(partial.tensors) == wrote[r]
        assert partial.holds == ()
        [replica_set] = partial.replicated
        assert (replica_set.replicas, replica_set.count) == (4, 64)
        assert set(replica_set.wrote) == wrote[r]
        held = set(state) - wrote[r]
        assert len(held) > 0
        assert [n for n in held if n.encode() in raw] == []
    for c in cs:
        c.close()


def test_a_partial_of_version_1_naming_what_its_rank_holds_still_commits(tmp_path):
    """A root written mid-upgrade: rank 1's partial is in the previous form (its held tensors
    by name in "holds", no replica sets); ckptd finalize still merges and commits it."""
    from ckptd.manifest.encode import encode_doc
    from ckptd.manifest.parse import decode, whole_doc
    from ckptd.writer import commit

    state = {f"t{i}": torch.full((10,), float(i)) for i in range(8)}
    cs, storage, path = _uncommitted(str(tmp_path), state)
    doc = whole_doc(storage.read_bytes(path), path)
    [(_, count, _, wrote)] = doc.pop("replicated")
    del doc["partial"]
    doc["holds"] = sorted(set(state) - set(wrote))
    assert len(doc["holds"]) == count - len(wrote) > 0
    storage.put_atomic(path, encode_doc(doc))
    assert decode(storage.read_bytes(path), path).holds == tuple(doc["holds"])
    m = commit.finalize(storage, 1)
    assert m is not None and set(m.tensors) == set(state)
    for c in cs:
        c.close()


def test_a_tensor_held_by_a_rank_but_written_by_none_is_not_committed(tmp_path):
    """Rank 1's partial is rewritten to hold a tensor that no partial wrote (by name, as a
    partial of version 1 says it): the commit that ckptd finalize attempts from those partials
    refuses it, naming tensor and rank."""
    from ckptd.manifest.parse import decode
    from ckptd.writer import commit

    cs, storage, path = _uncommitted(str(tmp_path), {"w": torch.ones(4)})
    p = decode(storage.read_bytes(path), path)
    storage.put_atomic(path, type(p)(**{**p.__dict__, "holds": ("ghost",)}).encode())
    with pytest.raises(ckptd.StateMismatch, match=r"ghost: held by rank 1 but saved by no rank"):
        commit.finalize(storage, 1)
    for c in cs:
        c.close()


def test_replicas_that_all_leave_a_tensor_to_another_copy_are_not_committed(tmp_path):
    """Both ranks say they hold copy 1 of 2 of every tensor: the tensors whose writer is copy
    0 are written by no rank, and the save fails on every rank naming the replica set."""
    cs = _sim(str(tmp_path), 2)
    state = {f"t{i}": ckptd.Shard(torch.ones(4), (4,), (0,), replica=1, replicas=2)
             for i in range(16)}
    hs = [c.save_async(state, step=1) for c in cs]
    for h in hs:
        with pytest.raises(ckptd.StateMismatch,
                           match=r"of the 16 tensors that ranks 0, 1 hold with replicas=2 were "
                                 r"saved by no rank"):
            h.result()
    assert not os.path.exists(tmp_path / L.manifest_path(1))
    for c in cs:
        c.close()


def test_storage_failure_surfaces_once_and_latest_stays_on_previous(tmp_path):
    root = str(tmp_path)
    with ckptd.Checkpointer(root, run_id="j") as good:
        good.save({"w": torch.ones(1 << 16)}, step=1)
    bad = ckptd.Checkpointer(root, run_id="j", storage=FailAfterBytes(root, limit=100_000))
    h = bad.save_async({"w": torch.full((1 << 16,), 2.0)}, step=2)
    with pytest.raises(StorageError, match="Input/output error"):
        bad.wait()
    bad.wait()  # raised exactly once
    assert h.phase.value == "failed"
    assert not os.path.exists(tmp_path / L.manifest_path(2))
    bad.close()
    with ckptd.Checkpointer(root) as c:
        assert c.latest_step() == 1
        dst = {"w": torch.zeros(1 << 16)}
        c.load(dst)
        assert torch.equal(dst["w"], torch.ones(1 << 16))


_FAILING_SAVE = """
import sys
import torch, ckptd
from faulty_storage import FailAfterBytes
root = sys.argv[1]
c = ckptd.Checkpointer(root, run_id="j", storage=FailAfterBytes(root, limit=100))
c.save_async({"w": torch.ones(1000)}, step=1)
if sys.argv[2] == "wait":
    c.wait()  # raises: unhandled, the interpreter prints its traceback
"""


@pytest.mark.parametrize("then", ["wait", "exit"])
def test_a_background_save_error_is_printed_once(tmp_path, then):
    # once: as the traceback of the call that raises it, or (no call came) at exit; never also
    # as a log line of the save thread
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", _FAILING_SAVE, str(tmp_path), then],
                       capture_output=True, text=True, env=env, timeout=120)
    if then == "wait":
        assert p.returncode == 1 and p.stderr.startswith("Traceback (most recent call last):")
        assert p.stderr.splitlines()[-1].endswith("r00000-0.bin: Input/output error")
    else:
        (line,) = [x for x in p.stderr.splitlines() if "Input/output error" in x]
        assert line.startswith("ckptd: a save did not complete before exit: ")


def _tiny_tmpfs(path) -> bool:
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


def test_full_disk_is_a_clear_error_and_commits_nothing(tmp_path):
    mnt = tmp_path / "small"
    mounted = _tiny_tmpfs(mnt)
    root = str(mnt / "root")
    try:
        with ckptd.Checkpointer(root, run_id="j") as c:
            c.save({"w": torch.ones(1000)}, step=1)
        storage = None if mounted else FailAfterBytes(root, 100_000, errno.ENOSPC)
        c = ckptd.Checkpointer(root, run_id="j", storage=storage)
        with pytest.raises(StorageError, match=r"disk full \(ENOSPC\)"):
            c.save({"w": torch.ones(1 << 20)}, step=2)  # 4 MiB into 512 KiB
        c.close()
        assert not os.path.exists(os.path.join(root, L.manifest_path(2)))
        with ckptd.Checkpointer(root) as c2:
            dst = {"w": torch.zeros(1000)}
            assert c2.load(dst).step == 1
            assert torch.equal(dst["w"], torch.ones(1000))
    finally:
        if mounted and subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)  # never left mounted


class _CountingStorage(ckptd.storage.LocalStorage):
    """Records what a waiting rank reads."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.whole: list[str] = []
        self.ranges: list[tuple[str, list[tuple[int, int]]]] = []

    def read_bytes(self, path: str) -> bytes:
        self.whole.append(path)
        return super().read_bytes(path)

    def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
        self.ranges.append((path, list(ranges)))
        return super().read_ranges(path, ranges)


def test_a_waiting_rank_learns_the_commit_from_the_manifests_first_bytes(tmp_path):
    """Not the whole manifest (5 MB for a 70B model at 1024 ranks, read by every rank after
    every save): its first bytes name the step and attempt. Another attempt is not a commit of
    ours; a manifest not in the writer's form (format 2) is read whole, as before."""
    from ckptd.writer import commit

    root = str(tmp_path / "ck")
    big = {f"w{i}": torch.zeros(4) for i in range(200)}  # a manifest well over the prefix
    with ckptd.Checkpointer(root, run_id="job") as ck:
        ck.save(big, step=3)
        attempt = ck.read_manifest(3).attempt
    st = _CountingStorage(root)
    commit.wait_committed(st, 3, attempt)
    assert st.whole == [] and st.ranges == [(L.manifest_path(3), [(0, 512)])]
    assert os.path.getsize(os.path.join(root, L.manifest_path(3))) > 10 * 512
    with config.override(commit_timeout_s=0.3, poll_min_s=0.05, poll_max_s=0.1), \
            pytest.raises(ckptd.CkptdError, match="no commit"):
        commit.wait_committed(st, 3, "job-999999")  # the manifest names another attempt
    old = os.path.join(os.path.dirname(__file__), "fixtures", "format2")
    st = _CountingStorage(old)
    raw = open(os.path.join(old, L.manifest_path(7)), "rb").read()
    commit.wait_committed(st, 7, open_doc(raw, "m")["attempt"])
    assert st.whole == [L.manifest_path(7)]


def test_a_partial_of_a_newer_version_is_refused_naming_the_file(tmp_path):
    from ckptd.manifest.encode import encode_doc
    from ckptd.manifest.parse import decode, whole_doc
    from ckptd.writer import commit

    cs, storage, path = _uncommitted(str(tmp_path), {"w": torch.ones(4)})
    doc = whole_doc(storage.read_bytes(path), path)
    doc["partial"] = 4
    storage.put_atomic(path, encode_doc(doc))
    with pytest.raises(ckptd.CorruptCheckpoint,
                       match=r"00001.json: malformed manifest .*partial version 4: this reader "
                             r"knows 1 to 3"):
        decode(storage.read_bytes(path), path)
    with pytest.raises(ckptd.CorruptCheckpoint, match=r"partial version 4"):
        commit.finalize(storage, 1)
    for c in cs:
        c.close()


def test_a_rank_waiting_for_the_commit_polls_without_walking_paths(tmp_path):
    """Rank 1 waits for rank 0's commit: each poll asks the storage's probe (one stat of the
    manifest and of the FAILED marker in directories opened once), walks no path and reads
    nothing until the manifest appears."""
    import threading

    from ckptd.storage.local import LocalStorage

    polled = threading.Event()
    seen = {"polls": 0, "walks_while_polling": 0, "manifest_reads": 0}

    class Watched(LocalStorage):
        def _walk(self, parts, create):  # type: ignore[no-untyped-def]
            if 2 <= seen["polls"] < 6:
                seen["walks_while_polling"] += 1
            return super()._walk(parts, create)

        def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
            seen["manifest_reads"] += path.endswith("manifest.json")
            return super().read_ranges(path, ranges)

        def probe(self, paths):  # type: ignore[no-untyped-def]
            import contextlib

            @contextlib.contextmanager
            def counted():  # type: ignore[no-untyped-def]
                with super(Watched, self).probe(paths) as ask:
                    def poll() -> list[bool]:
                        seen["polls"] += 1
                        if seen["polls"] >= 6:
                            polled.set()
                        return ask()
                    yield poll
            return counted()

    root = str(tmp_path)
    c0 = ckptd.Checkpointer(root, rank=0, world_size=2, run_id="job")
    c1 = ckptd.Checkpointer(root, rank=1, world_size=2, run_id="job", storage=Watched(root))
    state = {"w": torch.ones(4)}
    h1 = c1.save_async(state, step=1)
    assert polled.wait(60)
    assert seen["walks_while_polling"] == 0
    assert seen["manifest_reads"] == 0
    c0.save_async(state, step=1).result()
    assert h1.result().step == 1
    assert seen["manifest_reads"] >= 1
    for c in (c0, c1):
        c.close()


def test_a_coordinator_takes_the_partials_its_process_wrote_and_merges_the_same_bytes(
        tmp_path, monkeypatch):
    """Ranks saving in one process (as a node agent writes its node's ranks) leave their
    partials in memory for its coordinator: none is read back, and the manifest is the one the
    partials on storage merge into, byte for byte — tensors sharded, replicated and empty,
    values of every kind, per-rank values, training metadata."""
    from dataclasses import replace

    from ckptd.manifest import decode, merge
    from ckptd.storage.local import LocalStorage
    from ckptd.writer import commit, own_partials

    monkeypatch.setattr(own_partials, "_every_rank", True)  # as the node agent does
    reads: list[str] = []
    real = commit._read_partial
    monkeypatch.setattr(commit, "_read_partial",
                        lambda st, path: reads.append(path) or real(st, path))
    root = str(tmp_path)
    cs = _sim(root, 3, agent=False)
    hs = []
    for r, c in enumerate(cs):
        state = {
            "w": ckptd.Shard(torch.full((2, 3), float(r)), (6, 3), (2 * r, 0)),
            "shared": torch.arange(5.0),  # replicated: one rank writes it
            "empty": torch.zeros(0, 4),
            "lr": 3e-4, "name": "run", "flags": (True, None, 2), "nested": {"a": [1, 2.5]},
            "blob": b"\x00\xff",
            "loader": ckptd.Local({"position": 100 + r}),
        }
        hs.append(c.save_async(state, step=4, training={"tokens": 123, "mix": [0.5, 0.5]}))
    for h in hs:
        h.result()
    assert reads == []  # each partial taken from memory (before: one read per rank)
    st = LocalStorage(root)
    raw = st.read_bytes(L.manifest_path(4))
    committed = decode(raw, "m")
    again = replace(merge(commit.read_partials(st, 4, committed.attempt)),
                    generation=committed.generation)
    assert again.encode() == raw
    for c in cs:
        c.close()


def test_a_rank_saving_in_process_keeps_no_partial_but_rank_0_s(tmp_path, monkeypatch):
    """Outside the node agent only rank 0's own partial is kept for its coordinator: another
    rank's would never be taken (its coordinator is another process) and would stay until 64
    newer ones pushed it out. What is kept holds no chunk's frame table (a large save's are
    large): the manifest names them by reference."""
    from ckptd.writer import own_partials

    kept: list[tuple[str, object]] = []
    real = own_partials._kept.put
    monkeypatch.setattr(own_partials._kept, "put",
                        lambda st, path, p: kept.append((path, p)) or real(st, path, p))
    cs = _sim(str(tmp_path), 2, agent=False)
    hs = [c.save_async({"w": ckptd.Shard(torch.full((2,), float(r)), (4,), (2 * r,))}, step=1)
          for r, c in enumerate(cs)]
    for h in hs:
        h.result()
    assert [path.rpartition("/")[2] for path, _ in kept] == ["00000.json"]
    chunks = [c for e in kept[0][1].tensors.values() for c in e.chunks]  # type: ignore[attr-defined]
    assert chunks and all(c.frames is None and c.ref is not None for c in chunks)
    for c in cs:
        c.close()


def test_the_coordinator_decodes_each_partial_with_the_collector_paused(tmp_path, monkeypatch):
    """A thousand ranks' partials are hundreds of thousands of small objects without cycles:
    decoding them as they arrive runs with the cyclic collector paused, as the merge does."""
    import gc

    from ckptd.writer import commit

    enabled: list[bool] = []
    real = commit._read_partial
    monkeypatch.setattr(commit, "_read_partial",
                        lambda st, path: enabled.append(gc.isenabled()) or real(st, path))
    assert gc.isenabled()
    cs = _sim(str(tmp_path), 2, agent=False)
    hs = [c.save_async({"w": ckptd.Shard(torch.full((2,), float(r)), (4,), (2 * r,))}, step=1)
          for r, c in enumerate(cs)]
    for h in hs:
        h.result()
    assert enabled == [False]  # rank 1's partial, read back (rank 0's is taken from memory)
    assert gc.isenabled()
    for c in cs:
        c.close()
