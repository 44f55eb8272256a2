"""One storage suite for every backend (local directory, memory://, S3 on moto), then S3 faults.

S3 runs with 64 KiB parts (see conftest), so a few hundred KiB already make many-part uploads and
many ranged GETs. Faults come from a real HTTP proxy between the client and the moto server
(tests/fault_proxy.py), not from patching the client.
"""

from __future__ import annotations

import inspect
import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from fault_proxy import FaultProxy, Request

from ckptd.errors import StorageError
from ckptd.storage.base import Delegating, Storage, as_storage
from ckptd.storage.s3_storage import S3Storage
from ckptd.storage.s3_transfer import S3Transfer

if TYPE_CHECKING:
    from conftest import S3Bucket

PART = 64 << 10  # the part size of the s3 backend in tests (conftest.TEST_PART_BYTES)


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def irregular(data: bytes) -> Iterator[Any]:
    """``data`` as buffers of awkward sizes and kinds (bytes, bytearray, memoryview, empty)."""
    cuts = [0, 1, 1, 1000, PART - 7, PART + 3, 3 * PART + 11]
    cuts = sorted({min(c, len(data)) for c in cuts} | {len(data)})
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        kind = i % 3
        yield data[lo:hi] if kind == 0 else bytearray(data[lo:hi]) if kind == 1 else memoryview(
            data
        )[lo:hi]
    yield b""


class TestEveryBackend:
    def test_implements_every_method_of_the_contract_with_its_parameters(
        self, backend: Storage
    ) -> None:
        """The abstract methods and the ones with a default alike: compare each method's
        parameters (names, kinds, defaults) with the contract's (an override that drops the
        gate, say, would pass ``isinstance`` and not honour it)."""
        assert isinstance(backend, Storage)

        def params(fn: Any) -> list[tuple[str, Any, Any]]:
            return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

        methods = [n for n, v in vars(Storage).items() if callable(v) and not n.startswith("_")]
        assert {"write_file", "put_atomic", "read_bytes", "read_ranges", "remove", "open_read",
                "append_text", "incomplete_uploads", "abort_incomplete_uploads"} <= set(methods)
        for name in methods:
            assert params(getattr(type(backend), name)) == params(getattr(Storage, name)), name
        first, longest = backend.poll_interval_s
        assert 0 < first <= longest


    def test_multi_part_object_round_trips_bit_exact(self, backend: Storage) -> None:
        data = payload(10 * PART + 12345)
        assert backend.write_file("data/0/a.bin", irregular(data)) == len(data)
        assert backend.size("data/0/a.bin") == len(data)
        assert backend.read_bytes("data/0/a.bin") == data

    def test_caller_may_reuse_a_buffer_once_it_is_yielded(self, backend: Storage) -> None:
        chunks = [payload(PART // 2 + 1, seed=s) for s in range(7)]

        def refilled() -> Iterator[bytearray]:
            buf = bytearray(len(chunks[0]))
            for chunk in chunks:
                buf[:] = chunk
                yield buf

        backend.write_file("reused.bin", refilled())
        assert backend.read_bytes("reused.bin") == b"".join(chunks)

    def test_empty_and_small_objects(self, backend: Storage) -> None:
        assert backend.write_file("empty.bin", []) == 0
        assert backend.size("empty.bin") == 0
        assert backend.read_bytes("empty.bin") == b""
        assert backend.write_file("small.bin", [b"ab", b"", b"c"]) == 3
        assert backend.read_bytes("small.bin") == b"abc"

    def test_write_file_passes_every_byte_through_the_writer_s_gate(self, backend: Storage) -> None:
        """``write_file``'s gate: how the node agent paces a data file and stops it between
        blocks."""
        data = payload(10 * PART + 12345)
        seen: list[int] = []
        assert backend.write_file("data/0/g.bin", [data], seen.append) == len(data)
        assert seen and sum(seen) >= len(data)  # (S3 announces whole parts)
        calls = len(seen)
        assert backend.write_file("data/0/h.bin", [data]) == len(data)  # no gate: not called
        assert len(seen) == calls

    def test_read_ranges_returns_exactly_the_requested_bytes(self, backend: Storage) -> None:
        n = 5 * PART + 77
        data = payload(n, seed=1)
        backend.write_file("r.bin", [data])
        ranges = [
            (0, 1), (n - 1, 1), (0, n), (PART - 1, 2), (PART // 2, 3 * PART), (17, 0),
            (3 * PART, 2 * PART + 77), (5, 10), (5, 10), (n, 0), (2 * PART, PART),
        ]
        got = backend.read_ranges("r.bin", ranges)
        assert [len(g) for g in got] == [length for _, length in ranges]
        assert got == [data[o : o + length] for o, length in ranges]
        assert backend.read_ranges("r.bin", []) == []

    @pytest.mark.parametrize("past_end", [(1, 2), (0, 1), (-5, 10)])
    def test_read_past_the_end_is_an_eof_error(
        self, backend: Storage, past_end: tuple[int, int]
    ) -> None:
        backend.write_file("short.bin", [b"0123456789"])
        offset, length = 10 - past_end[0], past_end[1]
        with pytest.raises(EOFError, match="short.bin"):
            backend.read_ranges("short.bin", [(0, 3), (offset, length)])

    def test_put_atomic_overwrites_and_leaves_nothing_else(self, backend: Storage) -> None:
        backend.put_atomic("000001/manifest.json", b'{"v": 1}')
        backend.put_atomic("000001/manifest.json", b'{"v": 2, "longer": true}')
        assert backend.read_bytes("000001/manifest.json") == b'{"v": 2, "longer": true}'
        assert backend.list_dir("000001") == ["manifest.json"]

    def test_put_visible_overwrites_atomically_and_leaves_nothing_else(
        self, backend: Storage
    ) -> None:
        backend.put_visible("ranks/a/00001.json", b'{"v": 1}')
        backend.put_visible("ranks/a/00001.json", b'{"v": 2, "longer": true}')
        assert backend.read_bytes("ranks/a/00001.json") == b'{"v": 2, "longer": true}'
        assert backend.list_dir("ranks/a") == ["00001.json"]

    def test_list_dir_names_direct_children_only(self, backend: Storage) -> None:
        for path in ["a/b/c.bin", "a/d.json", "a/e/f/g.bin", "ab/x", "top.json"]:
            backend.put_atomic(path, path.encode())
        assert backend.list_dir("a") == ["b", "d.json", "e"]
        assert backend.list_dir("") == ["a", "ab", "top.json"]
        assert backend.list_dir("a/e") == ["f"]
        assert backend.list_dir("missing") == []
        assert backend.list_dir("a/d.json") == []

    def test_remove_takes_a_prefix_but_not_its_siblings(self, backend: Storage) -> None:
        for path in ["s/1/x", "s/1/y/z", "s/10/x", "s/1x", "t"]:
            backend.put_atomic(path, b"1")
        backend.write_file("s/1/big.bin", [payload(3 * PART)])
        backend.remove("s/1")
        assert backend.list_dir("s") == ["10", "1x"]
        assert [backend.exists(p) for p in ["s/1/x", "s/1/y/z", "s/1/big.bin"]] == [False] * 3
        backend.remove("t")
        assert backend.exists("t") is False
        backend.remove("never/was")  # absent is not an error
        assert backend.list_dir("") == ["s"]

    def test_exists_and_size(self, backend: Storage) -> None:
        backend.write_file("d/f.bin", [payload(PART + 1)])
        assert backend.exists("d/f.bin") is True
        assert backend.exists("d") is True
        assert backend.exists("d/f") is False
        assert backend.exists("nothing") is False
        assert backend.size("d/f.bin") == PART + 1

    @pytest.mark.parametrize("op", ["read_bytes", "read_ranges", "size"])
    def test_missing_object_is_file_not_found(self, backend: Storage, op: str) -> None:
        backend.put_atomic("there.json", b"{}")
        call: dict[str, Any] = {
            "read_bytes": lambda: backend.read_bytes("gone.json"),
            "read_ranges": lambda: backend.read_ranges("gone.json", [(0, 1)]),
            "size": lambda: backend.size("gone.json"),
        }
        with pytest.raises(FileNotFoundError, match="gone.json"):
            call[op]()

    def test_concurrent_writers_each_get_their_own_bytes(self, backend: Storage) -> None:
        datas = {f"w/{i}.bin": payload(3 * PART + i, seed=i) for i in range(6)}
        assert write_concurrently(backend, {p: irregular(d) for p, d in datas.items()}) == []
        assert {p: backend.read_bytes(p) for p in datas} == datas


# -- S3 specifics ------------------------------------------------------------------------------


def write_concurrently(storage: Storage, parts: dict[str, Any]) -> list[BaseException]:
    """``storage.write_file(path, parts[path])`` for every path, each in its own thread; the
    errors raised."""
    errors: list[BaseException] = []

    def write(path: str) -> None:
        try:
            storage.write_file(path, parts[path])
        except BaseException as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=write, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def uploads_in_progress(bucket: S3Bucket) -> list[str]:
    resp = bucket.client().list_multipart_uploads(Bucket=bucket.bucket)
    return [u["Key"] for u in resp.get("Uploads", [])]


def keys(bucket: S3Bucket) -> list[str]:
    resp = bucket.client().list_objects_v2(Bucket=bucket.bucket)
    return sorted(o["Key"] for o in resp.get("Contents", []))


@pytest.fixture
def proxy(s3_bucket: S3Bucket) -> Iterator[FaultProxy]:
    with FaultProxy(s3_bucket.server.port, seed=1234) as p:
        yield p


def is_upload_part(req: Request) -> bool:
    return req.method == "PUT" and "partNumber=" in req.path


class DictStorage:
    """The eight methods of the Storage protocol and nothing else, over a dict."""

    url = "dict://"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def write_file(self, path: str, parts: Any) -> int:
        data = b"".join(bytes(p) for p in parts)
        with self.lock:
            self.objects[path] = data
        return len(data)

    def put_atomic(self, path: str, data: bytes) -> None:
        with self.lock:
            self.objects[path] = bytes(data)

    def read_bytes(self, path: str) -> bytes:
        with self.lock:
            return self.objects[path] if path in self.objects else _missing(path)

    def read_ranges(self, path: str, ranges: Any) -> Any:
        data = self.read_bytes(path)
        out = []
        for offset, length in ranges:
            if offset + length > len(data):
                raise EOFError(path)
            out.append(data[offset:offset + length])
        return out

    def size(self, path: str) -> int:
        return len(self.read_bytes(path))

    def exists(self, path: str) -> bool:
        with self.lock:
            return path in self.objects or any(k.startswith(path + "/") for k in self.objects)

    def list_dir(self, path: str) -> list[str]:
        base = f"{path}/" if path else ""
        with self.lock:
            return sorted({k[len(base):].split("/")[0] for k in self.objects
                           if k.startswith(base)})

    def remove(self, path: str) -> None:
        with self.lock:
            for k in [k for k in self.objects if k == path or k.startswith(path + "/")]:
                del self.objects[k]


def _missing(path: str) -> bytes:
    raise FileNotFoundError(path)


def test_a_storage_with_only_the_eight_methods_saves_loads_and_collects() -> None:
    """A user's own backend needs only the protocol: the optional methods' defaults
    (ranged-read sessions, read + rewrite appends, filesystem poll bounds, no uploads) carry a
    save with metrics, a resharding load and ``gc``."""
    import torch

    from ckptd import Checkpointer
    from ckptd.writer.retention import collect_garbage

    storage = DictStorage()
    assert not isinstance(storage, Storage)
    ext = as_storage(storage)
    assert isinstance(ext, Delegating) and ext.incomplete_uploads() == []
    seen: list[int] = []  # and the gate, block by block as it takes the parts
    assert ext.write_file("g.bin", [b"x" * 10, b"y" * 5], seen.append) == 15
    assert seen == [10, 5] and storage.objects["g.bin"] == b"x" * 10 + b"y" * 5
    ckpt = Checkpointer("dict://", storage=storage, keep_last=0)
    w = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    for step in (1, 2):
        ckpt.save_async({"w": w + step}, step=step).result()
    assert storage.objects["metrics.jsonl"].count(b"\n") == 2  # appended, not overwritten
    got = {"w": torch.zeros(10, 100)}
    assert Checkpointer("dict://", storage=storage).load(got, step=1).step == 1
    assert torch.equal(got["w"], w + 1)
    report = collect_garbage(storage, keep_last=1)
    assert report.removed_committed == [1] and report.aborted_uploads == 0
    assert not any(k.startswith("step-000000001") for k in storage.objects), sorted(storage.objects)


class TestS3:
    def test_url_is_the_root_and_keys_sit_under_the_prefix(self, s3_bucket: S3Bucket) -> None:
        storage = S3Storage(s3_bucket.url + "/", s3_bucket.storage_options)
        assert storage.url == "s3://ckptd-test/run"
        storage.put_atomic("latest", b"7")
        assert keys(s3_bucket) == ["run/latest"]

    def test_a_write_its_gate_stops_between_two_parts_leaves_no_object_and_no_upload(
        self, s3_bucket: S3Bucket
    ) -> None:
        class Stop(Exception):
            pass

        calls: list[int] = []

        def gate(nbytes: int) -> None:
            calls.append(nbytes)
            if len(calls) == 3:  # two parts under way
                raise Stop

        storage = s3_bucket.storage(single_put_parts=1)
        with pytest.raises(Stop):
            storage.write_file("data/z.bin", [payload(5 * PART)], gate)
        assert len(calls) == 3
        assert keys(s3_bucket) == []
        assert uploads_in_progress(s3_bucket) == []  # aborted, not left for `ckptd gc`

    def test_objects_up_to_single_put_parts_are_one_put_and_larger_ones_multipart(
        self, s3_bucket: S3Bucket, proxy: FaultProxy
    ) -> None:
        assert S3Transfer().single_put_parts == 8  # 128 MiB with the default 16 MiB parts
        storage = s3_bucket.storage(proxy.endpoint_url)  # 64 KiB parts: single PUTs to 512 KiB
        client = s3_bucket.client()
        eight = [payload(3 * PART), bytearray(payload(5 * PART, seed=1))]
        cases: list[tuple[str, Any, bytes, int, str]] = [
            # name, buffers, content, requests, ETag suffix ("": one PUT, "-N": N parts)
            ("eight.bin", eight, b"".join(eight), 1, ""),
            ("nine.bin", [payload(8 * PART + 1)], payload(8 * PART + 1), 1 + 9 + 1, "-9"),
            ("empty.bin", [], b"", 1, ""),
            # a producer's size is not known in advance: multipart once it exceeds one part
            ("gen.bin", iter([payload(2 * PART)]), payload(2 * PART), 1 + 2 + 1, "-2"),
            ("gen1.bin", iter([payload(PART)]), payload(PART), 1, ""),
        ]
        for name, buffers, content, requests, suffix in cases:
            before = proxy.counts["forwarded"]
            assert storage.write_file(name, buffers) == len(content)
            assert proxy.counts["forwarded"] - before == requests, name
            etag = client.head_object(Bucket="ckptd-test", Key=f"run/{name}")["ETag"]
            assert etag.endswith(f'{suffix}"') if suffix else "-" not in etag, (name, etag)
            assert storage.read_bytes(name) == content
        # single_put_parts=1: only an object that fits in one part is a PUT (the old rule)
        one = s3_bucket.storage(single_put_parts=1)
        one.write_file("six.bin", [payload(5 * PART + 1)])
        one.write_file("one.bin", [payload(PART)])
        assert client.head_object(Bucket="ckptd-test", Key="run/six.bin")["ETag"].endswith('-6"')
        assert "-" not in client.head_object(Bucket="ckptd-test", Key="run/one.bin")["ETag"]
        assert uploads_in_progress(s3_bucket) == []

    @pytest.mark.parametrize("kind", ["reset", "500"])
    def test_a_retried_single_put_sends_the_whole_body_again(
        self, s3_bucket: S3Bucket, proxy: FaultProxy, kind: str
    ) -> None:
        """The body is a file object that an attempt reads to its end; the next attempt must
        send (and checksum, and sign) it from the start again."""
        storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=4)
        data = payload(6 * PART + 5)
        failed: list[str] = []

        def first_two_puts(req: Request) -> bool:
            if req.method == "PUT" and len(failed) < 2:
                failed.append(req.path)
                return True
            return False

        proxy.fail_all(kind=kind, match=first_two_puts)
        assert storage.write_file("again.bin", [memoryview(data)]) == len(data)
        proxy.heal()
        assert failed == ["/ckptd-test/run/again.bin"] * 2 and proxy.counts[kind] == 2
        assert storage.read_bytes("again.bin") == data
        assert "-" not in s3_bucket.client().head_object(
            Bucket="ckptd-test", Key="run/again.bin")["ETag"]

    def test_bodies_beyond_the_memory_budget_wait_for_each_other_and_all_land(
        self, s3_bucket: S3Bucket
    ) -> None:
        """concurrency x part_bytes bounds the bodies held at once (here 2 parts' worth); a
        single PUT of 6 parts exceeds it, and goes when nothing else is held."""
        storage = s3_bucket.storage(concurrency=2)
        datas = {f"d/{i}.bin": payload(6 * PART + i, seed=i) for i in range(3)}
        datas["d/mp.bin"] = payload(11 * PART, seed=9)  # multipart, 2 parts in flight at most
        assert write_concurrently(storage, {p: [d] for p, d in datas.items()}) == []
        for path, data in datas.items():
            assert storage.read_bytes(path) == data

    def test_a_failing_producer_aborts_the_upload(self, s3_bucket: S3Bucket) -> None:
        def parts() -> Iterator[bytes]:
            yield payload(3 * PART)
            raise RuntimeError("encoder crashed")

        with pytest.raises(RuntimeError, match="encoder crashed"):
            s3_bucket.storage().write_file("data/z.bin", parts())
        assert keys(s3_bucket) == []
        assert uploads_in_progress(s3_bucket) == []

    def test_transfer_defaults_follow_the_environment(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("CKPTD_S3_PART_BYTES", str(8 << 20))
        monkeypatch.setenv("CKPTD_S3_MAX_DELAY_S", "2.5")
        storage = S3Storage("s3://env-test/run")  # no request is made until it is used
        assert storage.transfer == S3Transfer(part_bytes=8 << 20, max_delay_s=2.5)

    def test_part_size_doubles_every_thousand_parts(self) -> None:
        from ckptd.storage.s3 import part_size

        sizes = [part_size(n, 16 << 20) for n in (1, 1000, 1001, 2001, 10_000)]
        assert sizes == [16 << 20, 16 << 20, 32 << 20, 64 << 20, 5 << 30]
        assert sum(part_size(n, 16 << 20) for n in range(1, 10_001)) > 5 << 40  # S3's max object

    def test_a_range_is_fetched_by_equal_gets_of_one_to_two_read_parts(
        self, s3_bucket: S3Bucket, proxy: FaultProxy
    ) -> None:
        from ckptd.storage.s3_read import split

        assert split(10, 0, 4) == []
        assert split(0, 3, 4) == [(0, 3)]  # shorter than the unit: one GET
        assert split(100, 7, 4) == [(100, 7)]  # under two units: still one
        assert split(0, 9, 4) == [(0, 4), (4, 5)]
        for length, unit in ((5 * PART + 77, PART), (64 << 20, 16 << 20), (12345, 1000)):
            pieces = split(7, length, unit)
            assert [p[0] for p in pieces] == [7 + sum(p[1] for p in pieces[:i])
                                              for i in range(len(pieces))]
            assert sum(n for _, n in pieces) == length
            assert all(unit <= n < 2 * unit for _, n in pieces)
            assert max(n for _, n in pieces) - min(n for _, n in pieces) <= 1
        data = payload(5 * PART + 77)
        s3_bucket.storage().write_file("g.bin", [data])
        storage = s3_bucket.storage(proxy.endpoint_url, read_part_bytes=PART)
        before = proxy.counts["forwarded"]
        got = storage.read_ranges("g.bin", [(0, len(data)), (3, 2 * PART - 1), (9, 0)])
        assert got == [data, data[3 : 2 * PART + 2], b""]
        assert proxy.counts["forwarded"] - before == 5 + 1  # 5 GETs, then 1, then none

    def test_ten_percent_faults_are_retried_to_bit_exact_results(
        self, s3_bucket: S3Bucket, proxy: FaultProxy
    ) -> None:
        # GETs of half a part, so that a range is many concurrent GETs
        storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=8, read_part_bytes=PART // 2)
        proxy.set_faults(0.10, kinds=("500", "503", "reset", "truncate"))
        datas = {f"data/{i}.bin": payload(8 * PART + 1000 * i, seed=i) for i in range(4)}
        for path, data in datas.items():
            assert storage.write_file(path, irregular(data)) == len(data)
        storage.put_atomic("000001/manifest.json", b'{"step": 1}')
        for path, data in datas.items():
            ranges = [(0, len(data)), (PART - 3, 2 * PART + 5), (len(data) - 1, 1)]
            got = storage.read_ranges(path, ranges)
            assert got == [data[o : o + length] for o, length in ranges]
            assert storage.read_bytes(path) == data
        assert storage.list_dir("data") == ["0.bin", "1.bin", "2.bin", "3.bin"]
        storage.remove("data")
        proxy.heal()
        assert keys(s3_bucket) == ["run/000001/manifest.json"]
        assert uploads_in_progress(s3_bucket) == []
        assert proxy.counts["forwarded"] > 100
        assert proxy.injected >= 8  # the retries were exercised, not skipped by luck

    def test_responses_cut_off_mid_body_are_read_again(
        self, s3_bucket: S3Bucket, proxy: FaultProxy
    ) -> None:
        data = payload(9 * PART + 5)
        s3_bucket.storage().write_file("cut.bin", [data])
        storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=10, read_part_bytes=PART)
        proxy.set_faults(0.3, kinds=("truncate",))
        got = storage.read_ranges("cut.bin", [(0, len(data)), (3, PART)])
        assert got == [data, data[3 : 3 + PART]]
        assert storage.read_bytes("cut.bin") == data
        assert proxy.counts["truncate"] >= 2

    def test_attempts_are_bounded_and_not_multiplied_by_botocore(
        self, s3_bucket: S3Bucket, proxy: FaultProxy
    ) -> None:
        storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=3)
        proxy.fail_all(kind="503")
        with pytest.raises(StorageError) as err:
            storage.put_atomic("000002/manifest.json", b"{}")
        assert str(err.value) == (
            "s3://ckptd-test/run/000002/manifest.json: PUT failed after 3 attempts: "
            "SlowDown (HTTP 503)"
        )
        assert proxy.counts["503"] == 3

    def test_persistent_part_failures_abort_the_upload(
        self, s3_bucket: S3Bucket, proxy: FaultProxy
    ) -> None:
        storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=3)
        proxy.fail_all(after=2, kind="500", match=is_upload_part)
        with pytest.raises(StorageError, match="failed after 3 attempts") as err:
            storage.write_file("data/x.bin", [payload(12 * PART)])
        assert str(err.value).startswith("s3://ckptd-test/run/data/x.bin: upload part ")
        assert str(err.value).endswith("InternalError (HTTP 500)")
        assert isinstance(err.value.__cause__, Exception)
        assert keys(s3_bucket) == []  # no partial object is visible
        assert uploads_in_progress(s3_bucket) == []  # aborted in line

    def test_outage_leaves_no_object_and_gc_aborts_the_upload(
        self, s3_bucket: S3Bucket, proxy: FaultProxy
    ) -> None:
        storage = s3_bucket.storage(proxy.endpoint_url, max_attempts=3)
        proxy.fail_all(after=3, kind="reset")
        with pytest.raises(StorageError) as err:
            storage.write_file("data/y.bin", [payload(12 * PART)])
        message = str(err.value)
        assert message.startswith("s3://ckptd-test/run/data/y.bin: upload part ")
        assert "failed after 3 attempts: " in message
        assert "incomplete upload" in message and "left for `ckptd gc`" in message
        assert "\n" not in message
        proxy.heal()
        assert keys(s3_bucket) == []
        assert uploads_in_progress(s3_bucket) == ["run/data/y.bin"]
        assert storage.abort_incomplete_uploads("data") == 1
        assert uploads_in_progress(s3_bucket) == []

    def test_abort_incomplete_uploads_spares_younger_and_foreign_uploads(
        self, s3_bucket: S3Bucket
    ) -> None:
        client = s3_bucket.client()
        for key in ["run/data/a.bin", "run/data/b.bin", "other/data/c.bin"]:
            client.create_multipart_upload(Bucket="ckptd-test", Key=key)
        storage = s3_bucket.storage()
        initiated = client.list_multipart_uploads(Bucket="ckptd-test")["Uploads"][0]["Initiated"]
        age_s = time.time() - initiated.timestamp()  # moto reports a fixed date in 2010
        assert storage.abort_incomplete_uploads("data", min_age_s=age_s + 3600) == 0
        assert len(uploads_in_progress(s3_bucket)) == 3
        assert storage.abort_incomplete_uploads("data") == 2
        assert uploads_in_progress(s3_bucket) == ["other/data/c.bin"]

    def test_stalled_requests_time_out_and_are_retried(
        self, s3_bucket: S3Bucket, proxy: FaultProxy
    ) -> None:
        data = payload(6 * PART)
        s3_bucket.storage().write_file("slow.bin", [data])
        options = s3_bucket.options(proxy.endpoint_url)
        options["config_kwargs"] = {"read_timeout": 0.3}  # passes through to botocore
        transfer = S3Transfer(part_bytes=PART, read_part_bytes=PART, max_attempts=8,
                              base_delay_s=0.001)
        storage = S3Storage(s3_bucket.url, options, transfer=transfer)
        proxy.stall(0.5, seconds=30.0)
        start = time.monotonic()
        got = storage.read_ranges("slow.bin", [(i * PART, PART) for i in range(6)])
        assert got == [data[i * PART : (i + 1) * PART] for i in range(6)]
        assert proxy.counts["stalled"] >= 1
        assert time.monotonic() - start < 15  # no read waited for its stalled response

    def test_missing_s3fs_gives_the_install_hint(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "s3fs", None)
        with pytest.raises(ImportError, match=r"pip install 'ckptd\[s3\]'"):
            S3Storage("s3://bucket/x", {})

    def test_transfer_settings_are_validated(self) -> None:
        with pytest.raises(ValueError, match="must be positive"):
            S3Transfer(part_bytes=0)


def test_deferred_durability_flushes_once_on_leaving_and_not_after_an_error(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from ckptd.storage import local
    from ckptd.storage.local import LocalStorage

    calls = {"fsync": 0, "sync": 0}
    real_fsync, real_sync = os.fsync, local._sync_filesystem

    def fsync(fd: int) -> None:
        calls["fsync"] += 1
        real_fsync(fd)

    def sync(root: str) -> None:
        calls["sync"] += 1
        real_sync(root)  # the real syncfs: it must succeed on a local root

    monkeypatch.setattr(local.os, "fsync", fsync)
    monkeypatch.setattr(local, "_sync_filesystem", sync)
    s = LocalStorage(str(tmp_path), direct=False)
    with s.deferred_durability():
        for i in range(5):
            s.write_file(f"d/{i}.bin", [b"x" * 100])
            s.put_atomic(f"d/{i}.json", b"{}")
        assert calls == {"fsync": 0, "sync": 0}
    assert calls == {"fsync": 0, "sync": 1}
    s.put_atomic("after.json", b"{}")  # durable on its own again: the file and its directory
    assert calls == {"fsync": 2, "sync": 1}
    with pytest.raises(RuntimeError), s.deferred_durability():
        s.write_file("e.bin", [b"y"])
        raise RuntimeError("a writer failed")
    assert calls["sync"] == 1  # nothing is made durable for a write that will not be used
    assert s.read_bytes("d/4.bin") == b"x" * 100 and s.read_bytes("e.bin") == b"y"


def test_a_closed_checkpointer_keeps_no_directory_of_its_root_open(tmp_path) -> None:
    # a user unmounts the filesystem after training: nothing of this process may hold it busy
    import os

    import torch

    import ckptd

    root = tmp_path / "root"

    def held() -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(root)):
                out.append(target)
        return out

    with ckptd.Checkpointer(str(root), agent=False) as ck:
        ck.save({"w": torch.ones(4)}, step=1)
        out = {"w": torch.zeros(4)}
        ck.load(out)  # a load keeps the directories it read from open for the next one
        assert held()
    assert held() == []
    assert torch.equal(out["w"], torch.ones(4))
