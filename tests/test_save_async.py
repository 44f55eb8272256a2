"""save_async: staging semantics, buffer reuse, in-flight policy, overlap, host budget."""

from __future__ import annotations

import logging
import os
import re
import threading
import time

import pytest
import torch

import ckptd
from ckptd.storage.local import LocalStorage
from ckptd.writer.handle import Phase


def _state(v: float, n: int = 4096) -> dict:
    return {
        "model": {"a": torch.full((n,), v), "b": torch.full((64, 64), v)},
        "optim": {"m": torch.full((n,), -v)},
    }


def _load(c: ckptd.Checkpointer, step: int | None = None) -> dict:
    dst = _state(0.0)
    c.load(dst, step=step)
    return dst


@pytest.mark.parametrize("pipelined", [0, 1])
def test_mutating_every_tensor_right_after_save_async_does_not_change_what_was_saved(
        tmp_path, pipelined):
    from ckptd import config

    # several data files, handed to the writers while staging (1) or after it (0)
    with config.override(pipelined_staging=pipelined, min_file_bytes=8192, stage_threads=2), \
            ckptd.Checkpointer(str(tmp_path)) as c:
        state = _state(1.0)
        h = c.save_async(state, step=1)
        assert h.phase in (Phase.STAGED, Phase.COMMITTED)
        for t in (state["model"]["a"], state["model"]["b"], state["optim"]["m"]):
            t.mul_(0).add_(7.0)
        assert h.result().step == 1
        got = _load(c)
        assert torch.equal(got["model"]["a"], torch.full((4096,), 1.0))
        assert torch.equal(got["optim"]["m"], torch.full((4096,), -1.0))


def _arenas(c: ckptd.Checkpointer) -> int:
    """Staging arenas of one size a save needs: one in process; with the node agent also the
    one it keeps the newest step in (``docs/agent.md``, *The memory tier*)."""
    return 2 if c.executor == "agent" else 1


def test_fifty_back_to_back_saves_leave_exactly_keep_last_bit_exact_steps(tmp_path):
    c = ckptd.Checkpointer(str(tmp_path), keep_last=3, max_inflight=1)
    state = _state(0.0)
    for step in range(50):
        for t in (state["model"]["a"], state["model"]["b"]):
            t.fill_(float(step))
        state["optim"]["m"].fill_(-float(step))
        c.save_async(state, step=step)
    c.wait()
    # the staging arena was allocated once and reused (with the node agent, one more: the
    # agent keeps the newest step in the arena it was staged in)
    assert c.pool.allocations == _arenas(c)
    c.close()  # retention of the last save runs after its commit; close() drains it
    steps = sorted(int(p.name[5:]) for p in tmp_path.glob("step-*"))
    assert steps == [47, 48, 49]
    with ckptd.Checkpointer(str(tmp_path)) as reader:
        for step in steps:
            got = _load(reader, step)
            assert torch.equal(got["model"]["b"], torch.full((64, 64), float(step)))
            assert torch.equal(got["optim"]["m"], torch.full((4096,), -float(step)))


def test_retention_runs_after_the_commit_without_holding_it_and_before_the_next_commit(tmp_path):
    """Removing an old step starts once the commit that owes it is written, in the background:
    that save's handle does not wait for it, and no next save is needed to start it; the next
    save's commit waits for it (the disk holds keep_last + 1 committed steps at most). The
    storage's removal of step 1 is held until the test releases it."""
    removing, release = threading.Event(), threading.Event()

    class Held(LocalStorage):
        def remove(self, path: str) -> None:
            if path.startswith("step-"):
                removing.set()
                assert release.wait(60)
            super().remove(path)

    def steps() -> list[int]:
        return sorted(int(p.name[5:]) for p in tmp_path.glob("step-*"))

    c = ckptd.Checkpointer(str(tmp_path), storage=Held(str(tmp_path)), keep_last=1)
    c.save(_state(1.0), step=1)
    assert c.save_async(_state(2.0), step=2).result().step == 2  # its retention is held
    assert removing.wait(60)  # ... and started without a next save
    try:
        h3 = c.save_async(_state(3.0), step=3)
        assert not h3.done()  # its commit waits for the space step 1 frees
        assert (tmp_path / "step-000000001").exists()
    finally:
        release.set()
    assert h3.result().step == 3
    c.close()  # waits for what step 3's commit started
    assert steps() == [3]
    with ckptd.Checkpointer(str(tmp_path)) as reader:
        dst = _state(0.0)
        assert reader.load(dst).step == 3
        assert torch.equal(dst["optim"]["m"], torch.full((4096,), -3.0))


def test_the_retention_of_successive_commits_runs_on_one_background_thread(tmp_path):
    """A commit hands its retention to a thread that stays for the next one: no thread is
    started between a manifest and its handle (on a busy host, waiting until a new thread
    first runs was the longest step there)."""
    ran: list[threading.Thread] = []

    class Recorded(ckptd.KeepLast):
        def keep(self, steps):  # type: ignore[no-untyped-def]
            ran.append(threading.current_thread())
            return super().keep(steps)

    with ckptd.Checkpointer(str(tmp_path), retention=Recorded(1), agent=False) as c:
        for step in range(1, 5):
            c.save(_state(float(step)), step=step)
    assert len(ran) == 3  # after the commits of steps 2, 3, 4 (one step: nothing to judge)
    assert all(t is ran[0] for t in ran) and ran[0] is not threading.main_thread()
    assert ran[0].name == "ckptd-retention" and ran[0].daemon
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step-*")) == [4]


def test_a_failing_retention_never_fails_a_committed_save(tmp_path, caplog):
    """Every removal fails (a bug or a storage fault, not only an OSError): each save still
    commits and returns, the failure is logged, and the next commit tries again."""
    tries: list[str] = []

    class Broken(LocalStorage):
        def remove(self, path: str) -> None:
            if path.startswith("step-"):
                tries.append(path)
                raise RuntimeError(f"{path}: cannot remove")
            super().remove(path)

    with caplog.at_level(logging.WARNING, logger="ckptd"):
        with ckptd.Checkpointer(str(tmp_path), storage=Broken(str(tmp_path)), keep_last=1) as c:
            for step in (1, 2, 3):
                assert c.save(_state(float(step)), step=step).step == step
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step-*")) == [1, 2, 3]
    assert len(tries) >= 2  # after the commits of steps 2 and 3
    assert "retention under" in caplog.text and "RuntimeError" in caplog.text


def test_a_save_fsyncs_its_data_its_frame_table_and_its_manifest_only(tmp_path):
    """What durability needs of a one-rank save: its data file and frame table (the manifest
    names them), the manifest and its directory. The partial (read by the live coordinator)
    and the advisory latest are made visible atomically, not synced."""
    synced: list[str] = []

    class Counted(LocalStorage):
        def _sync(self, fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            super()._sync(fd)

    with ckptd.Checkpointer(str(tmp_path), storage=Counted(str(tmp_path)), keep_last=0) as c:
        c.save({"w": torch.ones(16)}, step=1)  # the owner's claim and a first save
        synced.clear()
        c.save({"w": torch.ones(16)}, step=2)
    names = sorted(p.removeprefix(str(tmp_path) + "/") for p in synced)
    assert len(names) == 4, names
    assert sum("/data/" in n for n in names) == 2, names  # r00000-0.bin, r00000.frames
    assert "step-000000002" in names and any("manifest.json" in n for n in names)
    assert not any("/ranks/" in n or n.startswith("latest") for n in names), names


def test_a_small_one_file_save_is_written_by_its_save_thread_and_a_larger_one_by_the_io_threads(
        tmp_path):
    """A state that makes one small file: the save thread writes it itself (no hand-off to an
    I/O thread and back, which costs more than the write on a busy host); several files still
    go to the I/O threads, in parallel. Either way the data loads back bit-exact."""
    from ckptd import config

    writers: list[tuple[int, str]] = []

    class Threads(LocalStorage):
        def write_file(self, path, parts, gate=None):  # type: ignore[no-untyped-def]
            if path.endswith(".bin"):
                step = int(path.split("/")[0].removeprefix("step-"))
                writers.append((step, threading.current_thread().name))
            return super().write_file(path, parts, gate)

    with ckptd.Checkpointer(str(tmp_path), storage=Threads(str(tmp_path)), agent=False) as c:
        c.save(_state(1.0), step=1)
        with config.override(min_file_bytes=8192, pipelined_staging=0):
            c.save(_state(2.0), step=2)
        assert torch.equal(_load(c, 1)["model"]["b"], torch.full((64, 64), 1.0))
        assert torch.equal(_load(c, 2)["optim"]["m"], torch.full((4096,), -2.0))
    one = [name for step, name in writers if step == 1]
    several = [name for step, name in writers if step == 2]
    assert len(one) == 1 and one[0].startswith("ckptd-save"), writers
    assert len(several) > 1 and all(n.startswith("ckptd-io") for n in several), writers


def test_a_state_saved_again_reuses_its_checked_boxes_and_each_change_is_saved(tmp_path):
    """Describing a sharded state checks each leaf's box against its global shape; a state
    saved every few steps is described again each time, and the same inputs give the same
    (immutable) box, checked once. A change of shape, sharding or dtype is still seen: a box
    outside its global shape is refused, and each saved step loads back as it was."""
    from ckptd import sharding
    from ckptd.errors import StateMismatch

    def tree(t: torch.Tensor, gshape: tuple[int, ...], offsets: tuple[int, ...]) -> dict:
        return {"w": ckptd.Shard(t, gshape, offsets)}

    first = sharding.describe(tree(torch.ones(4, 2), (8, 2), (4, 0)), 0, 1).pieces[0].box
    again = sharding.describe(tree(torch.zeros(4, 2), (8, 2), (4, 0)), 0, 1).pieces[0].box
    assert again is first
    moved = sharding.describe(tree(torch.zeros(4, 2), (8, 2), (0, 0)), 0, 1).pieces[0].box
    assert (moved.offsets, moved.sizes) == ((0, 0), (4, 2))
    with pytest.raises(StateMismatch, match=r"w: box at offsets \(6, 0\) of sizes \(4, 2\) "
                                            r"exceeds global shape \(8, 2\)"):
        sharding.describe(tree(torch.zeros(4, 2), (8, 2), (6, 0)), 0, 1)

    saved = {1: torch.arange(8.0).reshape(4, 2), 2: torch.arange(12.0).reshape(6, 2),
             3: torch.arange(12, dtype=torch.float64).reshape(6, 2)}
    with ckptd.Checkpointer(str(tmp_path), keep_last=None, agent=False) as c:
        for step, t in saved.items():
            c.save(tree(t, tuple(t.shape), (0, 0)), step=step)
        for step, t in saved.items():
            got = torch.full_like(t, -1.0)
            c.load(tree(got, tuple(t.shape), (0, 0)), step=step)
            assert got.dtype == t.dtype and torch.equal(got, t), step


def test_staging_buffers_are_reused_and_grow_only_when_the_state_grows(tmp_path):
    with ckptd.Checkpointer(str(tmp_path)) as c:
        c.save(_state(1.0), step=1)
        c.save(_state(2.0), step=2)
        c.save(_state(3.0, n=1000), step=3)  # smaller: fits
        per = _arenas(c)  # arenas per state size: one, or two with the node agent's kept step
        assert c.pool.allocations == per
        c.save(_state(4.0, n=100_000), step=4)  # larger: one more allocation (each)
        c.save(_state(5.0, n=100_000), step=5)
        assert c.pool.allocations == 2 * per
        assert c.pool.nbytes < per * (2 * (100_000 * 4 * 2 + 64 * 64 * 4) + 3 * 4096)


def test_on_busy_skip_drops_the_new_save_and_says_so(tmp_path, caplog):
    from ckptd import config

    with ckptd.Checkpointer(
        str(tmp_path / "r"), rank=0, world_size=2, run_id="j", on_busy="skip"
    ) as c:
        with config.override(commit_timeout_s=5.0):
            first = c.save_async(_state(1.0), step=1)  # waits for rank 1's partial
            with caplog.at_level(logging.WARNING, logger="ckptd"):
                second = c.save_async(_state(2.0), step=2)
            assert second.phase is Phase.SKIPPED
            assert "step 2 skipped" in caplog.text
            other = ckptd.Checkpointer(str(tmp_path / "r"), rank=1, world_size=2, run_id="j")
            other.save_async(_state(1.0), step=1).result()
            other.close()
            assert first.result().step == 1


class _HeldWrites(LocalStorage):
    """Data files of step 1 are written only once ``release`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def write_file(self, path, parts, gate=None):  # type: ignore[no-untyped-def]
        if path.startswith("step-000000001/data/"):
            self.release.wait()
        return super().write_file(path, parts, gate)


def test_overlap_stages_in_the_background_until_wait_staged(tmp_path):
    """With overlap=True the copy happens on the save thread: while that thread is still busy
    with step 1 (its writes held), step 2's save_async has returned and nothing is staged."""
    storage = _HeldWrites(str(tmp_path))
    with ckptd.Checkpointer(str(tmp_path), storage=storage, max_inflight=2) as c:
        first = c.save_async(_state(1.0), step=1)
        state = _state(3.0)
        try:
            h = c.save_async(state, step=2, overlap=True)
            phase = h.phase
        finally:
            storage.release.set()  # whatever happened: the checkpointer must be able to close
        assert phase is Phase.STAGING  # it returned before staging: the save thread was busy
        h.wait_staged()
        state["model"]["a"].fill_(-1.0)  # allowed after wait_staged
        first.result()
        h.result()
        assert torch.equal(_load(c, 2)["model"]["a"], torch.full((4096,), 3.0))


def test_debug_mode_detects_a_modification_before_wait_staged(tmp_path):
    with ckptd.Checkpointer(str(tmp_path), debug_overlap=True) as c:
        state = _state(3.0)
        c.save(state, step=0)
        h = c.save_async(state, step=1, overlap=True)
        h.staged.result()  # let staging finish first, so the detection is deterministic
        state["model"]["b"].fill_(5.0)  # the caller's error: modified before wait_staged()
        with pytest.raises(ckptd.CorruptCheckpoint, match="model/b: modified before wait_staged"):
            h.wait_staged()
        h.result()


def test_a_state_larger_than_the_host_budget_is_written_in_rounds(tmp_path, caplog):
    big = {"w": torch.arange(300_000, dtype=torch.float32), "v": torch.randn(1000, 50)}
    with ckptd.Checkpointer(str(tmp_path), host_budget_bytes=256 * 1024) as c:
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            h = c.save_async(big, step=1)
        assert "over the host budget" in caplog.text
        assert h.phase in (Phase.STAGED, Phase.COMMITTED)
        h.result()
        assert c.pool.nbytes <= 256 * 1024
        m = c.read_manifest(1)
        assert len(m.tensors["w"].chunks) >= 4  # the 1.2 MB tensor was split into row ranges
        dst = {"w": torch.zeros(300_000), "v": torch.zeros(1000, 50)}
        c.load(dst)
        assert torch.equal(dst["w"], big["w"]) and torch.equal(dst["v"], big["v"])
        with pytest.raises(ckptd.CkptdError, match="overlap=True needs the state staged at once"):
            c.save_async(big, step=2, overlap=True)


def test_every_rank_logs_its_save_line_at_info_and_rank_0_alone_appends_metrics(
        tmp_path, caplog):
    import json

    cs = [ckptd.Checkpointer(str(tmp_path), rank=r, world_size=2, run_id="job", agent=False)
          for r in range(2)]
    with caplog.at_level(logging.INFO, logger="ckptd"):
        hs = [c.save_async({"w": ckptd.Shard(torch.full((2,), float(r)), (4,), (2 * r,))},
                           step=1) for r, c in enumerate(cs)]
        for h in hs:
            h.result()
    lines = [json.loads(r.getMessage().removeprefix("ckptd save "))
             for r in caplog.records if r.getMessage().startswith("ckptd save ")]
    assert sorted((x["rank"], x["step"]) for x in lines) == [(0, 1), (1, 1)]
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["rank"], x["step"]) for x in metrics] == [(0, 1)]
    for c in cs:
        c.close()


def test_save_result_and_metrics_line(tmp_path):
    import json

    with ckptd.Checkpointer(str(tmp_path)) as c:
        r = c.save(_state(1.0), step=9)
        assert r.nbytes == (4096 * 4) * 2 + 64 * 64 * 4
        assert r.stall_s > 0 and r.write_s > 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    assert rec["step"] == 9 and rec["nbytes"] == r.nbytes and rec["world_size"] == 1


class _SlowStorage(LocalStorage):
    """A storage link of ~20 MB/s (an object store's single stream), not a local disk."""

    def write_file(self, path, parts, gate=None):
        parts = [memoryview(p).cast("B") for p in parts]
        n = super().write_file(path, parts, gate)
        time.sleep(n / 20e6)  # the link's transfer time: the bandwidth being simulated
        return n


def test_compression_auto_compresses_only_when_the_storage_is_slower_than_zstd(tmp_path):
    state = {"w": torch.randn(1 << 20).to(torch.bfloat16)}  # 2 MiB, planes+zstd ~1.4x
    root = str(tmp_path / "slow")
    with ckptd.Checkpointer(root, compression="auto", storage=_SlowStorage(root)) as c:
        raw = c.save(state, step=1)
        compressed = c.save(state, step=2)
        codecs_used = [{ch.codec for ch in c.read_manifest(s).tensors["w"].chunks} for s in (1, 2)]
        assert codecs_used == [{"raw"}, {"zstd-planes"}]
        assert compressed.nbytes * 1.2 < raw.nbytes
        dst = {"w": torch.zeros(1 << 20, dtype=torch.bfloat16)}
        c.load(dst)
        assert torch.equal(dst["w"], state["w"])


def test_an_urgent_save_is_raw_and_reuses_the_staging_buffers_of_a_compressed_run(tmp_path):
    state = {"w": torch.randn(1 << 18).to(torch.bfloat16), "b": torch.arange(1000.0)}
    with ckptd.Checkpointer(str(tmp_path / "c"), compression="zstd") as c:
        c.save(state, step=1)
        state["w"].mul_(2)
        r = c.save(state, step=2, urgent=True)  # the preemption save
        c.save(state, step=3)
        codecs_used = [{ch.codec for t in c.read_manifest(s).tensors.values() for ch in t.chunks}
                       for s in (1, 2, 3)]
        assert codecs_used == [{"zstd-planes"}, {"raw"}, {"zstd-planes"}]
        assert r.nbytes == 2 * (1 << 18) + 4 * 1000  # raw: every byte as in memory
        assert c.pool.allocations == _arenas(c)  # one staging arena for all three saves
        dst = {"w": torch.zeros(1 << 18, dtype=torch.bfloat16), "b": torch.zeros(1000)}
        c.load(dst, step=2)
        assert torch.equal(dst["w"], state["w"]) and torch.equal(dst["b"], state["b"])


def test_interpreter_exit_drains_in_flight_saves(tmp_path):
    import subprocess
    import sys

    code = (
        "import torch, ckptd\n"
        f"ckptd.init({str(tmp_path)!r})\n"
        "ckptd.save_async({'w': torch.arange(1 << 20, dtype=torch.float32)}, step=3)\n"
        # no wait(), no close(): the interpreter exits with the save in flight
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with ckptd.Checkpointer(str(tmp_path)) as c:
        assert c.latest_step() == 3
        dst = {"w": torch.zeros(1 << 20)}
        c.load(dst)
        assert torch.equal(dst["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_reserve_allocates_the_staging_memory_before_the_first_save(tmp_path):
    with ckptd.Checkpointer(str(tmp_path)) as c:
        state = _state(1.0)
        reserved = c.reserve(state)
        assert c.pool.allocations == _arenas(c) and c.pool.nbytes >= reserved
        c.save(state, step=1)
        assert c.pool.allocations == _arenas(c)  # the first save reused the reserved arena


def test_the_staging_copy_is_exact_and_never_waits_for_a_helper_that_gets_no_cpu():
    from ckptd.writer import memcopy

    src = torch.randint(0, 255, (3 * memcopy.SEGMENT + 12344,), dtype=torch.uint8)
    small = torch.arange(1000, dtype=torch.int64)
    for threads in (1, 2, 4):
        dst = torch.zeros(src.numel() + small.numel() * 8 + 64, dtype=torch.uint8)
        copies = [(dst.data_ptr(), src.data_ptr(), src.numel()),
                  (dst.data_ptr() + src.numel() + 64, small.data_ptr(), small.numel() * 8),
                  (dst.data_ptr(), src.data_ptr(), 0)]
        memcopy.copy_all(copies, threads=threads)
        assert torch.equal(dst[: src.numel()], src)
        assert torch.equal(dst[src.numel() + 64 :].view(torch.int64), small)
    # the only helper thread is busy elsewhere: the caller copies every segment itself, and
    # returns while the helper is still busy (a caller that waited for it would never return)
    release = threading.Event()
    busy = memcopy._helpers(1).submit(release.wait)
    dst = torch.zeros_like(src)
    done = threading.Event()
    copier = threading.Thread(
        target=lambda: (memcopy.copy_all([(dst.data_ptr(), src.data_ptr(), src.numel())],
                                         threads=2), done.set()))
    copier.start()
    try:
        # a bound on the failure only: the copy takes milliseconds
        assert done.wait(60), "copy_all waited for a helper that never got to run"
        assert not busy.done() and torch.equal(dst, src)
    finally:
        release.set()
        busy.result()
        copier.join()


class _Gated(LocalStorage):
    """The data files of the steps in ``held`` are written once their event is set."""

    def __init__(self, root: str, steps: list[int]) -> None:
        super().__init__(root)
        self.held = {s: threading.Event() for s in steps}

    def write_file(self, path, parts, gate=None):  # type: ignore[no-untyped-def]
        for step, event in self.held.items():
            if path.startswith(f"step-{step:09d}/data/"):
                # a bound on the failure only (the test releases it): the old code never does
                assert event.wait(60), f"step {step} was never released"
        return super().write_file(path, parts, gate)


class _ReleaseWhenWaiting(logging.Handler):
    """Releases the held steps a save says it waits for, once it has decided to wait."""

    def __init__(self, storage: _Gated) -> None:
        super().__init__(logging.DEBUG)
        self.storage = storage

    def emit(self, record: logging.LogRecord) -> None:
        if "waits for the save of" in record.getMessage():
            for step in record.args[1]:  # type: ignore[index]
                self.storage.held[step].set()


def test_a_save_that_waits_for_an_earlier_one_says_so_once_and_records_the_wait(
        tmp_path, caplog):
    import json

    storage = _Gated(str(tmp_path), [1, 2])
    release = _ReleaseWhenWaiting(storage)
    logger = logging.getLogger("ckptd")
    logger.addHandler(release)
    try:
        with caplog.at_level(logging.DEBUG, logger="ckptd"), \
                ckptd.Checkpointer(str(tmp_path), storage=storage, max_inflight=1) as c:
            first = c.save_async(_state(1.0), step=1)  # its writes are held
            assert c.inflight == (first,)
            second = c.save_async(_state(2.0), step=2)  # waits for step 1; its writes held
            third = c.save_async(_state(3.0), step=3)  # waits for step 2
            c.wait()
            assert c.inflight == ()
    finally:
        logger.removeHandler(release)
        for event in storage.held.values():
            event.set()
    assert first.waited_s == 0.0 and first.result().waited_s == 0.0
    for h in (second, third):
        assert h.waited_s > 0 and h.result().waited_s == h.waited_s
        assert h.result().stall_s >= h.waited_s
    said = [r for r in caplog.records if r.levelno == logging.WARNING and "waited" in r.message]
    assert len(said) == 1, [r.message for r in said]
    assert re.search(r"step 2 waited \d+\.\d\d s for the save of step 1", said[0].message)
    for remedy in ("max_inflight", "save less often", "faster storage"):
        assert remedy in said[0].message
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    waits = {rec["step"]: rec["wait_s"] for rec in lines}
    assert waits[1] == 0 and waits[2] > 0 and waits[3] > 0
