"""Checkpoints on S3: save, commit, list, load, reshard and the CLI against a real moto server,
most of it through the fault-injecting proxy (tests/fault_proxy.py).

What is checked is the checkpoint-level contract on an object store: every commit loads back
bit-exact under 10 % request faults; a save that fails part-way raises a ckptd error naming the
object, commits nothing, and leaves the previous step the newest; ``latest`` is only a hint; a
wait for a commit polls an object store at most about once a second; ``ckptd gc`` aborts the
multipart uploads that failed saves leave behind.

States are small and S3 parts 64 KiB (conftest), with ``min_file_bytes`` and ``frame_bytes``
lowered so that a save still writes several multipart files and a load many framed ranged reads.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from typing import TYPE_CHECKING, Any

import multirank
import pytest
import torch
from fault_proxy import FaultProxy, Request

import ckptd
from ckptd import catalog, config
from ckptd.cli import main as cli_main
from ckptd.errors import CkptdError, StorageError
from ckptd.manifest import layout as L
from ckptd.storage import LocalStorage
from ckptd.storage.base import poll_interval
from ckptd.storage.fsspec_backend import FsspecStorage
from ckptd.writer import commit as C
from ckptd.writer import retention

if TYPE_CHECKING:
    from conftest import S3Bucket

ROWS, COLS = 96, 192  # every 2-d tensor; rows split over 2 ranks, columns over 3


@pytest.fixture(autouse=True)
def small_files() -> Iterator[None]:
    """Several data files per save (~100 KiB: multipart at 64 KiB parts with
    ``single_put_parts=1``, else one PUT each), many frames per chunk."""
    with config.override(min_file_bytes=96 << 10, frame_bytes=16 << 10, commit_timeout_s=60.0):
        yield


@pytest.fixture
def proxy(s3_bucket: S3Bucket) -> Iterator[FaultProxy]:
    with FaultProxy(s3_bucket.server.port, seed=20261122) as p:
        yield p


# ----------------------------------------------------------------------------- states


def full_state(seed: int) -> dict[str, Any]:
    """A small model + Adam state (~250 KiB): bf16 weights, fp32 master and moments, an int
    counter tensor, JSON values."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    w = randn(ROWS, COLS)
    return {
        "model": {"w": w.to(torch.bfloat16), "norm": randn(COLS).add_(1.0)},
        "optim": {
            "master": w.clone(),
            "exp_avg": randn(ROWS, COLS).mul_(1e-3),
            "exp_avg_sq": randn(ROWS, COLS).mul_(1e-3).square_(),
            "count": torch.arange(ROWS, dtype=torch.int64) * seed,
        },
        "step": seed,
        "loader": {"consumed": 1000 * seed, "epoch": seed // 7},
    }


def zeros_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None if not isinstance(state, int) else -1


def assert_bit_exact(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            assert_bit_exact(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert got.shape == want.shape, where
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    else:
        assert got == want, where


def row_shard(state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s share: 2-d tensors split by rows, 1-d ones replicated."""

    def leaf(t: torch.Tensor) -> Any:
        if t.dim() != 2:
            return t.clone()
        n = t.shape[0] // world
        return ckptd.Shard(t[rank * n : (rank + 1) * n].clone(), tuple(t.shape), (rank * n, 0))

    return {
        "model": {k: leaf(v) for k, v in state["model"].items()},
        "optim": {k: leaf(v) for k, v in state["optim"].items()},
        "step": state["step"],
        "loader": dict(state["loader"]),
    }


def col_shards(state: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Zeroed destinations of another layout: 2-d tensors split by columns, 1-d ones whole."""
    out = []
    for r in range(world):
        n = COLS // world

        def leaf(t: torch.Tensor, r: int = r, n: int = n) -> Any:
            if t.dim() != 2:
                return torch.zeros_like(t)
            local = torch.zeros(t.shape[0], n, dtype=t.dtype)
            return ckptd.Shard(local, tuple(t.shape), (0, r * n))

        out.append(
            {
                "model": {k: leaf(v) for k, v in state["model"].items()},
                "optim": {k: leaf(v) for k, v in state["optim"].items()},
            }
        )
    return out


def checkpointer(storage: Any, **kw: Any) -> ckptd.Checkpointer:
    kw.setdefault("threads", 4)
    return ckptd.Checkpointer(storage.url, storage=storage, **kw)


def objects(bucket: S3Bucket, under: str = "") -> list[str]:
    client, keys, kw = bucket.client(), [], {"Bucket": bucket.bucket, "Prefix": f"run/{under}"}
    while True:
        page = client.list_objects_v2(**kw)
        keys += [o["Key"][len("run/") :] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return sorted(keys)
        kw["ContinuationToken"] = page["NextContinuationToken"]


def uploads(bucket: S3Bucket) -> list[str]:
    resp = bucket.client().list_multipart_uploads(Bucket=bucket.bucket)
    return sorted(u["Key"] for u in resp.get("Uploads", []))


def read_latest(bucket: S3Bucket) -> str:
    obj = bucket.client().get_object(Bucket=bucket.bucket, Key="run/latest")
    return str(obj["Body"].read().decode())


# ----------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("single_put_parts", [
    1, pytest.param(8, marks=pytest.mark.slow)], ids=["multipart", "single-put"])
def test_twenty_cycles_under_ten_percent_faults_commit_and_load_bit_exact(
    s3_bucket: S3Bucket, proxy: FaultProxy, single_put_parts: int
) -> None:
    # several GETs per read range (16 KiB each), so that faults hit them too; data files of
    # ~100 KiB are multipart uploads of 64 KiB parts, or (8 parts' worth: the default) one PUT
    storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=8, read_part_bytes=16 << 10,
                                single_put_parts=single_put_parts)
    proxy.set_faults(0.10, kinds=("500", "503", "reset", "truncate"))
    with checkpointer(storage, keep_last=3) as ck:
        for step in range(1, 21):
            state = full_state(step)
            result = ck.save(state)
            assert result.step == step and result.url == f"{s3_bucket.url}/{L.step_dir(step)}"
            dst = zeros_like(state)
            loaded = ck.load(dst)
            assert loaded.step == step
            assert_bit_exact(dst, state, f"step {step}")
        assert ck.latest_step() == 20
        files = {c.file for t in ck.read_manifest(20).tensors.values() for c in t.chunks}
        assert len(files) >= 2  # several data files per save...
    proxy.heal()
    assert proxy.injected >= 40 and proxy.counts["forwarded"] > 500  # faults were exercised
    assert catalog.committed_steps(storage) == [18, 19, 20]  # retention ran under faults too
    assert read_latest(s3_bucket) == L.step_dir(20)
    assert uploads(s3_bucket) == []  # every upload completed or was aborted
    client = s3_bucket.client()
    data = [k for k in objects(s3_bucket, L.step_dir(20)) if k.endswith(".bin")]
    for key in data:  # ... each a multipart upload, or a single PUT (no part count in its ETag)
        etag = client.head_object(Bucket="ckptd-test", Key=f"run/{key}")["ETag"]
        assert ("-" in etag) == (single_put_parts == 1), key


def test_latest_is_advisory_the_newest_committed_step_is_found_by_listing(
    s3_bucket: S3Bucket,
) -> None:
    storage = s3_bucket.storage()
    states = {s: full_state(s) for s in (1, 2, 3)}
    with checkpointer(storage, keep_last=0) as ck:
        for st in states.values():
            ck.save(st)
    client = s3_bucket.client()

    def newest_loads_step_3() -> None:
        with checkpointer(s3_bucket.storage(), keep_last=0) as fresh:  # a restarted job
            assert fresh.latest_step() == 3
            dst = zeros_like(states[3])
            assert fresh.load(dst).step == 3
            assert_bit_exact(dst, states[3])

    client.delete_object(Bucket="ckptd-test", Key="run/latest")  # missing
    newest_loads_step_3()
    for stale in (L.step_dir(1), L.step_dir(9), "garbage"):  # stale, dangling, unreadable
        client.put_object(Bucket="ckptd-test", Key="run/latest", Body=stale.encode())
        newest_loads_step_3()

    # Newer step directories that are not commits: data only (a rank died mid-save), and a
    # coordinator that gave up (FAILED marker, one of two partials).
    storage.write_file(f"{L.step_dir(5)}/data/x-000001/r00000-0.bin", [b"\0" * 1000])
    with config.override(commit_timeout_s=0.5):
        lone = ckptd.Checkpointer(s3_bucket.url, storage=storage, rank=0, world_size=2,
                                  run_id="lone", keep_last=0)
        with pytest.raises(CkptdError, match=r"ranks \[1\] did not finish"):
            lone.save(full_state(4))
        lone.close()
    assert storage.exists(L.failed_path(4, "lone-000001"))
    assert catalog.committed_steps(storage) == [1, 2, 3]
    newest_loads_step_3()

    # A coordinator that died between the partials and the manifest: the next reader
    # finalises the step (its data and partials are complete) and moves `latest`.
    with checkpointer(storage, keep_last=0, run_id="again") as ck:
        ck.save(full_state(6))
    client.delete_object(Bucket="ckptd-test", Key=f"run/{L.manifest_path(6)}")
    client.put_object(Bucket="ckptd-test", Key="run/latest", Body=L.step_dir(3).encode())
    assert catalog.committed_steps(storage) == [1, 2, 3]
    with checkpointer(s3_bucket.storage(), keep_last=0) as fresh:
        assert fresh.latest_step() == 6
        dst = zeros_like(full_state(6))
        assert fresh.load(dst).step == 6
        assert_bit_exact(dst, full_state(6))
    assert catalog.committed_steps(storage) == [1, 2, 3, 6]
    assert read_latest(s3_bucket) == L.step_dir(6)


def _save_requests(s3_bucket: S3Bucket, proxy: FaultProxy, ck: ckptd.Checkpointer) -> list[str]:
    """The requests of one fault-free save of step 1, in order ("METHOD key?query")."""
    seen: list[str] = []

    def record(req: Request) -> bool:
        seen.append(f"{req.method} {req.path}")
        return False

    proxy.fail_all(after=1 << 30, match=record)
    ck.save(full_state(1))
    proxy.heal()
    return seen


@pytest.mark.parametrize("single_put_parts", [
    1, pytest.param(8, marks=pytest.mark.slow)], ids=["multipart", "single-put"])
@pytest.mark.parametrize(
    ("point", "kind", "failing_object"),
    [
        ("first request", "503", "/data/"),
        ("mid-data", "reset", "/data/"),
        ("partial manifest", "500", "/ranks/"),
    ],
)
def test_an_outage_mid_save_fails_it_naming_the_object_and_the_previous_step_stays_newest(
    s3_bucket: S3Bucket, proxy: FaultProxy, point: str, kind: str, failing_object: str,
    single_put_parts: int,
) -> None:
    storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=3,
                                single_put_parts=single_put_parts)
    with checkpointer(storage, keep_last=0) as ck:  # no retention requests in between
        requests = _save_requests(s3_bucket, proxy, ck)
        # a save writes its data objects and frame table, then its partial, then the manifest
        partial = next(i for i, r in enumerate(requests) if "/ranks/" in r)
        manifest = next(i for i, r in enumerate(requests) if r.endswith("/manifest.json"))
        assert partial < manifest
        assert all("/data/" in r for r in requests[:partial])
        files = {r.split(" ")[1].split("?")[0] for r in requests[:partial] if ".bin" in r}
        parts = [r for r in requests[:partial] if "partNumber=" in r]
        if single_put_parts == 1:  # data files of ~100 KiB: 2 parts of 64 KiB, or more
            assert len(parts) >= 2 * len(files) and partial > 4
        else:  # the same files, each one PUT
            assert parts == [] and partial == len(files) + 1 >= 3  # and the frame table
            assert all(r.startswith("PUT ") for r in requests[:partial])
        after = {"first request": 0, "mid-data": partial // 2, "partial manifest": partial}[point]

        proxy.fail_all(after=after, kind=kind)
        with pytest.raises(CkptdError) as err:
            ck.save(full_state(2))
        proxy.heal()
        message = str(err.value)
        assert isinstance(err.value, StorageError)
        assert message.startswith(f"{s3_bucket.url}/{L.step_dir(2)}/"), message
        assert failing_object in message.split(":")[1] and "failed after 3 attempts" in message
        assert "\n" not in message

        assert L.manifest_path(2) not in objects(s3_bucket)
        assert read_latest(s3_bucket) == L.step_dir(1)
        assert catalog.committed_steps(storage) == [1]
    with checkpointer(s3_bucket.storage(), keep_last=3) as fresh:  # the restarted job
        assert fresh.latest_step() == 1
        dst = zeros_like(full_state(1))
        assert fresh.load(dst).step == 1
        assert_bit_exact(dst, full_state(1))
        fresh.save(full_state(2))  # and saves that step again, now that S3 is back
        dst = zeros_like(full_state(2))
        assert fresh.load(dst).step == 2
        assert_bit_exact(dst, full_state(2))


def test_a_failed_manifest_put_commits_nothing_and_every_rank_raises_the_reason(
    s3_bucket: S3Bucket, proxy: FaultProxy
) -> None:
    storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=3)
    ranks = [checkpointer(storage, rank=r, world_size=2, run_id="two") for r in range(2)]
    try:
        for r, ck in enumerate(ranks):
            ck.save_async(row_shard(full_state(1), r, 2))
        for ck in ranks:
            ck.wait()

        def manifest_put(req: Request) -> bool:
            return req.method == "PUT" and req.path.split("?")[0].endswith("/manifest.json")

        proxy.fail_all(kind="503", match=manifest_put)
        handles = [ck.save_async(row_shard(full_state(2), r, 2)) for r, ck in enumerate(ranks)]
        errors = []
        for h in handles:
            with pytest.raises(CkptdError) as err:
                h.result(timeout=60)
            errors.append(str(err.value))
        proxy.heal()
    finally:
        for ck in ranks:
            ck.close()
    want = f"{s3_bucket.url}/{L.manifest_path(2)}: PUT failed after 3 attempts: SlowDown (HTTP 503)"
    assert errors[0] == want
    assert errors[1] == f"step 2 was not committed: {want}"  # rank 1 learnt it from FAILED
    assert catalog.committed_steps(storage) == [1]
    with checkpointer(s3_bucket.storage(), rank=0, world_size=1) as fresh:
        assert fresh.latest_step() == 1  # the FAILED attempt is not finalised either
        dst = zeros_like(full_state(1))
        fresh.load(dst)
        assert_bit_exact(dst, full_state(1))


def _gloo_save(rank: int, world: int, endpoint: str, url: str) -> int:
    import os

    os.environ["CKPTD_S3_PART_BYTES"] = str(64 << 10)  # S3Transfer.from_env: multipart here too
    os.environ["CKPTD_S3_READ_PART_BYTES"] = str(16 << 10)  # and several GETs per read range
    os.environ["CKPTD_S3_BASE_DELAY_S"] = "0.002"
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    with config.override(min_file_bytes=96 << 10, frame_bytes=16 << 10):
        with ckptd.Checkpointer(url, storage_options=options, threads=2) as ck:
            assert (ck.rank, ck.world_size) == (rank, world)
            for step in (1, 2):
                ck.save(row_shard(full_state(step), rank, world))
            dst = row_shard(zeros_like(full_state(2)), rank, world)
            return ck.load(dst).step


def test_two_gloo_ranks_save_on_s3_and_three_ranks_load_another_layout(
    s3_bucket: S3Bucket, proxy: FaultProxy
) -> None:
    proxy.set_faults(0.05, kinds=("500", "503", "reset"))
    steps = multirank.run(_gloo_save, 2, proxy.endpoint_url, s3_bucket.url, timeout=120)
    assert steps == [2, 2]
    proxy.heal()
    assert proxy.injected >= 1
    storage = s3_bucket.storage()
    assert catalog.committed_steps(storage) == [1, 2]
    with checkpointer(storage, run_id="reader") as ck:
        manifest = ck.read_manifest(2)
    assert manifest.world_size == 2
    assert {c.rank for c in manifest.tensors["optim/master"].chunks} == {0, 1}

    want = full_state(2)
    dsts = col_shards(want, 3)
    readers = [checkpointer(storage, rank=r, world_size=3, run_id="reader") for r in range(3)]
    for r, ck in enumerate(readers):
        assert ck.load(dsts[r]).step == 2
        ck.close()
    for group in ("model", "optim"):
        for name, t in want[group].items():
            if t.dim() == 2:
                got = torch.cat([d[group][name].local for d in dsts], dim=1)
            else:
                got = dsts[0][group][name]
            assert_bit_exact(got, t, f"{group}/{name}")


def test_two_simulated_ranks_save_through_faults_and_one_rank_loads_it_whole(
    s3_bucket: S3Bucket, proxy: FaultProxy
) -> None:
    storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=8)
    proxy.set_faults(0.10)
    ranks = [checkpointer(storage, rank=r, world_size=2, run_id="sim", threads=2) for r in range(2)]
    for step in (3, 4):
        handles = [ck.save_async(row_shard(full_state(step), r, 2)) for r, ck in enumerate(ranks)]
        assert [h.result(timeout=60).step for h in handles] == [step, step]
    for ck in ranks:
        ck.close()
    with checkpointer(s3_bucket.storage(proxy.endpoint_url, max_attempts=8), run_id="one") as ck:
        dst = zeros_like(full_state(4))
        assert ck.load(dst).step == 4
    assert_bit_exact(dst, full_state(4))


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def test_an_s3_load_reads_whole_data_objects_and_within_a_small_budget_stays_in_it(
    s3_bucket: S3Bucket, proxy: FaultProxy
) -> None:
    """The remote read unit: with the default budget every data object is one range (fetched by
    GETs of 16 KiB here, through 10 % faults); with a 64 KiB budget the ranges shrink to a
    quarter of it and the reader holds at most the budget. Bit-exact both ways."""
    from ckptd.loader.load import last_stats

    storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=8, read_part_bytes=16 << 10)
    state = full_state(5)
    with checkpointer(storage, keep_last=0) as ck:
        ck.save(state, step=5)
        files = {c.file for t in ck.read_manifest(5).tensors.values() for c in t.chunks}
    assert len(files) >= 2
    proxy.set_faults(0.10, kinds=("500", "503", "reset", "truncate"))
    for budget in (None, 64 << 10):
        dst = zeros_like(state)
        with config.override(**({"load_budget_bytes": budget} if budget else {})), \
                checkpointer(storage, keep_last=0) as ck:
            assert ck.load(dst).step == 5
        assert_bit_exact(dst, state)
        stats = last_stats()
        assert stats is not None
        if budget is None:
            assert (stats.planned_ranges, stats.passes) == (len(files), 1)
        else:
            assert stats.planned_ranges > len(files) and stats.passes == 2
            assert 0 < stats.peak_buffer_bytes <= budget
    proxy.heal()
    assert proxy.injected >= 1


def test_a_corrupted_byte_in_an_s3_data_object_fails_the_load_naming_the_object(
    s3_bucket: S3Bucket,
) -> None:
    """Read through the ranged-GET path (several GETs per range), the frame checksums catch a
    byte flipped on the server; the load names the object and tensor and touches nothing."""
    storage = s3_bucket.storage(read_part_bytes=16 << 10)
    state = full_state(6)
    with checkpointer(storage, keep_last=0) as ck:
        ck.save(state, step=6)
        m = ck.read_manifest(6)
        (chunk,) = m.with_frames([("optim/master", m.tensors["optim/master"].chunks[0])])
    key = f"run/{L.step_dir(6)}/{chunk.file}"
    client = s3_bucket.client()
    blob = bytearray(client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read())
    blob[chunk.offset + chunk.frames[0].stored // 2] ^= 0x10
    client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=bytes(blob))
    dst = zeros_like(state)
    with checkpointer(storage, keep_last=0) as ck:
        with pytest.raises(ckptd.CorruptCheckpoint) as err:
            ck.load(dst)
    where = f"{s3_bucket.url}/{L.step_dir(6)}/{chunk.file}"
    assert f"{where}: optim/master: checksum mismatch in frame 0" in str(err.value)
    assert all(not t.any() for t in _tensors(dst))  # nothing was copied


# ----------------------------------------------------------------------------- polling


class CountingLocal(LocalStorage):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.calls = 0

    def read_bytes(self, path: str) -> bytes:
        self.calls += 1
        return super().read_bytes(path)

    def list_dir(self, path: str) -> list[str]:
        self.calls += 1
        return super().list_dir(path)

    def exists(self, path: str) -> bool:  # the probe's question while a directory is missing
        self.calls += 1
        return super().exists(path)


def test_poll_intervals_are_backend_aware(s3_bucket: S3Bucket, tmp_path: Any) -> None:
    assert poll_interval(LocalStorage(str(tmp_path))) == (0.001, 0.05)
    assert poll_interval(FsspecStorage("memory://poll-test")) == (0.001, 0.05)
    assert poll_interval(s3_bucket.storage()) == (0.05, 1.0)
    with config.override(remote_poll_min_s=0.1, remote_poll_max_s=0.5, poll_max_s=0.01):
        assert poll_interval(s3_bucket.storage()) == (0.1, 0.5)
        assert poll_interval(LocalStorage(str(tmp_path))) == (0.001, 0.01)


def _poll_bound(first: float, longest: float, timeout: float) -> int:
    return math.ceil(2 + math.log2(longest / first) + 2 * timeout / longest)


def test_waiting_for_a_commit_on_s3_polls_at_most_about_once_a_second(
    s3_bucket: S3Bucket, proxy: FaultProxy, tmp_path: Any
) -> None:
    storage = s3_bucket.storage(proxy.endpoint_url)
    timeout = 3.0
    with config.override(commit_timeout_s=timeout):
        before = proxy.counts["forwarded"]
        start = time.monotonic()
        with pytest.raises(CkptdError, match="step 7: no commit after 3s"):
            C.wait_committed(storage, 7, "nobody-000001")  # a rank whose coordinator is dead
        waited = time.monotonic() - start
        gets = proxy.counts["forwarded"] - before
        before = proxy.counts["forwarded"]
        with pytest.raises(CkptdError, match=r"step 7: ranks \[0, 1\] did not finish"):
            C.coordinate(storage, 7, "nobody-000001", 2, "run")  # partials that never come
        lists = proxy.counts["forwarded"] - before - 1  # and one PUT of the FAILED marker

    local = CountingLocal(str(tmp_path))
    with config.override(commit_timeout_s=1.0), pytest.raises(CkptdError, match="no commit"):
        C.wait_committed(local, 7, "nobody-000001")
    assert waited >= timeout
    polls = _poll_bound(0.05, 1.0, timeout)  # 13
    assert 2 * 3 <= gets <= 2 * polls  # GET manifest + GET FAILED per poll
    assert 3 <= lists <= polls  # one LIST per poll
    # a filesystem is polled every 1-50 ms, then less often as the wait goes on: ~15 in 1 s
    assert local.calls >= 2 * 10
    assert storage.list_dir(L.partials_dir(7, "nobody-000001")) == ["FAILED"]


# ----------------------------------------------------------------------------- the CLI


def ckptd_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli_main(list(argv))
        except SystemExit as e:  # argparse refusing the command line
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_cli_ls_inspect_verify_finalize_gc_on_s3(s3_bucket: S3Bucket, proxy: FaultProxy) -> None:
    opts = json.dumps(s3_bucket.options(proxy.endpoint_url))
    root = s3_bucket.url
    client = s3_bucket.client()
    with checkpointer(s3_bucket.storage(), keep_last=0) as ck:
        for s in (1, 2, 3):
            ck.save(full_state(s))
    # step 3's coordinator died after the partials: its manifest never appeared
    client.delete_object(Bucket="ckptd-test", Key=f"run/{L.manifest_path(3)}")

    code, out, _ = ckptd_cli("ls", root, "--storage-options", opts, "--json")
    assert code == 0
    assert [(r["step"], r["committed"]) for r in json.loads(out)] == [(1, True), (2, True),
                                                                      (3, False)]
    code, out, _ = ckptd_cli("--storage-options", opts, "inspect", root)  # before the command too
    assert code == 0 and f"checkpoint {root}/{L.step_dir(2)}" in out and "optim/exp_avg" in out
    code, out, _ = ckptd_cli("verify", f"{root}/{L.step_dir(2)}", "--storage-options", opts,
                             "--json")
    assert code == 0 and json.loads(out)["ok"] is True and json.loads(out)["tensors"] == 6

    code, out, _ = ckptd_cli("finalize", f"{root}/{L.step_dir(3)}", "--storage-options", opts,
                             "--json")
    assert (code, json.loads(out)) == (0, {"finalized": [3]})
    code, out, _ = ckptd_cli("verify", root, "--storage-options", opts)
    assert code == 0 and out.startswith("ok: step 3: 6 tensors")

    # A failed save (S3 unreachable mid-upload, even for the abort) leaves step 4's objects and
    # an incomplete upload behind; step 5 then commits.
    storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=2, single_put_parts=1)
    with checkpointer(storage, keep_last=0) as ck:  # data files as multipart uploads
        proxy.fail_all(after=3, kind="reset")  # no data file completes (each takes 4 requests)
        with pytest.raises(StorageError, match=f"{L.step_dir(4)}/data/"):
            ck.save(full_state(4))
        proxy.heal()
        ck.save(full_state(5))
    left = uploads(s3_bucket)
    assert left and all(k.startswith(f"run/{L.step_dir(4)}/data/") for k in left)

    code, _, err = ckptd_cli("gc", root, "--storage-options", opts, "--upload-min-age", "60")
    assert code == 2 and "must exceed the commit timeout" in err and "\n" not in err.strip()
    code, out, _ = ckptd_cli("gc", root, "--storage-options", opts, "--keep-last", "2", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["removed_committed"] == [1, 2] and report["removed_incomplete"] == [4]
    assert report["aborted_uploads"] == len(left)
    assert uploads(s3_bucket) == []
    assert {k.split("/")[0] for k in objects(s3_bucket)} == {
        "latest", "metrics.jsonl", "owner.json", L.step_dir(3), L.step_dir(5)
    }

    code, _, err = ckptd_cli("ls", root, "--storage-options", "{not json")
    assert code == 2 and "--storage-options" in err and "not JSON" in err
    with checkpointer(s3_bucket.storage(), keep_last=0) as fresh:
        dst = zeros_like(full_state(5))
        assert fresh.load(dst).step == 5
        assert_bit_exact(dst, full_state(5))


class RecordingStorage(LocalStorage):
    """A filesystem that says it has abandoned uploads, to check what gc asks to abort."""

    def __init__(self, root: str, uploads: list[str]) -> None:
        super().__init__(root)
        self.uploads = uploads
        self.aborts: list[tuple[str, float]] = []

    def incomplete_uploads(self, prefix: str = "") -> list[tuple[str, float]]:
        return [(u, 5.0) for u in self.uploads]

    def abort_incomplete_uploads(self, prefix: str = "", *, min_age_s: float = 0.0) -> int:
        self.aborts.append((prefix, min_age_s))
        return 1


def test_gc_aborts_only_uploads_no_save_in_flight_can_still_use(tmp_path: Any) -> None:
    storage = RecordingStorage(str(tmp_path / "root"), uploads=[])
    with checkpointer(storage, keep_last=0) as ck:
        for s in (1, 3, 5):
            ck.save(full_state(s))
        run = ck.run_id
    storage.remove(L.manifest_path(5))  # as if step 5 were still being saved
    storage.uploads = [
        f"{L.step_dir(2)}/data/{run}-000000/r00000-0.bin",  # nothing else left of step 2
        f"{L.step_dir(4)}/data/{run}-000009/r00000-0.bin",  # the owner's newest: in flight
    ]
    storage.put_atomic(f"{L.step_dir(4)}/ranks/{run}-000009/00000.json", b"{}")
    report = retention.collect_garbage(storage)
    assert report.removed_incomplete == [2] and report.aborted_uploads == 2
    assert storage.aborts == [(L.step_dir(2), 0.0), ("", 3600.0)]
    assert catalog.all_steps(storage) == [1, 3, 4, 5]

    storage.uploads = []
    with config.override(commit_timeout_s=7200.0):
        storage.aborts.clear()
        retention.collect_garbage(storage)  # the default follows a longer commit timeout
        assert storage.aborts == [("", 14400.0)]
        with pytest.raises(ValueError, match="must exceed the commit timeout"):
            retention.collect_garbage(storage, upload_min_age_s=7200.0)


# ----------------------------------------------------------------------------- reshard


def test_reshard_from_local_to_s3_and_back(s3_bucket: S3Bucket, tmp_path: Any) -> None:
    src, back = str(tmp_path / "src"), str(tmp_path / "back")
    want = full_state(8)
    ranks = [ckptd.Checkpointer(src, rank=r, world_size=2, run_id="local") for r in range(2)]
    handles = [ck.save_async(row_shard(want, r, 2)) for r, ck in enumerate(ranks)]
    for h in handles:
        h.result()
    for ck in ranks:
        ck.close()

    opts = json.dumps(s3_bucket.storage_options)
    code, out, err = ckptd_cli("reshard", src, "--to-world", "3", "--out", s3_bucket.url,
                               "--out-storage-options", opts, "--json")
    assert code == 0, err
    assert json.loads(out)["url"] == f"{s3_bucket.url}/{L.step_dir(8)}"
    code, out, err = ckptd_cli("verify", s3_bucket.url, "--storage-options", opts, "--json")
    assert code == 0 and json.loads(out)["ok"], err
    on_s3 = ckptd.Checkpointer(s3_bucket.url, storage=s3_bucket.storage(), run_id="r")
    assert on_s3.read_manifest(8).world_size == 3
    on_s3.close()

    code, out, err = ckptd_cli("--storage-options", opts, "reshard", s3_bucket.url,
                               "--to-world", "1", "--out", back, "--json")
    assert code == 0, err
    with ckptd.Checkpointer(back) as ck:
        assert ck.read_manifest(8).world_size == 1
        dst = zeros_like(want)
        assert ck.load(dst).step == 8
    assert_bit_exact(dst, want)
