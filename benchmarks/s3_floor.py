"""S3 throughput floor on a local moto server: boto3 and s3fs vs ckptd's FsspecStorage.

    python benchmarks/s3_floor.py [--mib 256] [--repeat 3] [--sweep]

Starts ``moto.server`` in a subprocess on 127.0.0.1 (port 0), moves one object of ``--mib`` MiB
up and down with each client, and prints the median MB/s of ``--repeat`` runs. ``--sweep`` also
varies FsspecStorage's part size and concurrency. The moto server is a single Python process, so
these figures measure the clients against *this* server's ceiling, not against S3.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

_MOTO_MAIN = """
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server
server = make_server("127.0.0.1", 0, DomainDispatcherApplication(create_backend_app), threaded=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"""
BUCKET = "bench"


def median_mbps(nbytes: int, fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()

    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    server = subprocess.Popen(
        [sys.executable, "-c", _MOTO_MAIN], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=env,
    )
    try:
        assert server.stdout is not None
        endpoint = f"http://127.0.0.1:{int(server.stdout.readline())}"
        run(endpoint, args.mib << 20, args.repeat, args.sweep)
    finally:
        server.terminate()
        server.wait()


def run(endpoint: str, n: int, repeat: int, sweep: bool) -> None:
    import boto3
    import s3fs
    from boto3.s3.transfer import TransferConfig

    from ckptd.storage.fsspec_backend import FsspecStorage, S3Transfer

    creds: dict[str, Any] = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds)

    def reset() -> None:
        req = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=60).close()
        client.create_bucket(Bucket=BUCKET)

    data = os.urandom(n)
    rows: list[tuple[str, float, float]] = []

    def measure(name: str, put: Callable[[], Any], get: Callable[[], bytes]) -> None:
        reset()
        up = median_mbps(n, put, repeat)
        got = get()
        if got != data:
            raise SystemExit(f"{name}: read back {len(got)} bytes that differ from what was put")
        down = median_mbps(n, get, repeat)
        rows.append((name, up, down))
        print(f"{name:<44} put {up:7.1f} MB/s   get {down:7.1f} MB/s", flush=True)

    measure(
        "boto3 put_object / get_object (1 request)",
        lambda: client.put_object(Bucket=BUCKET, Key="k", Body=data),
        lambda: client.get_object(Bucket=BUCKET, Key="k")["Body"].read(),
    )
    tc = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=16)

    def boto3_download() -> bytes:
        buf = io.BytesIO()
        client.download_fileobj(BUCKET, "k", buf, Config=tc)
        return buf.getvalue()

    measure(
        "boto3 TransferManager (16 MiB x 16 threads)",
        lambda: client.upload_fileobj(io.BytesIO(data), BUCKET, "k", Config=tc),
        boto3_download,
    )
    options: dict[str, Any] = {
        "key": "testing", "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    measure(
        "s3fs pipe_file / cat_file",
        lambda: fs.pipe_file(f"{BUCKET}/k", data),
        lambda: fs.cat_file(f"{BUCKET}/k"),
    )
    view = memoryview(data)
    configs = [(16, 16)]
    if sweep:
        # (n MiB parts x 1) is one GET per object: the client's own overhead, without moto's cost
        # of re-reading the whole object for every ranged GET.
        configs += [(8, 16), (32, 16), (64, 8), (16, 4), (16, 8), (16, 32), (n >> 20, 1)]
    for part_mib, conc in configs:
        storage = FsspecStorage(
            f"s3://{BUCKET}/ckpt", options,
            transfer=S3Transfer(part_bytes=part_mib << 20, concurrency=conc),
        )
        measure(
            f"ckptd FsspecStorage ({part_mib} MiB parts x {conc})",
            lambda s=storage: s.write_file(  # type: ignore[misc]
                "k", (view[i : i + (4 << 20)] for i in range(0, n, 4 << 20))
            ),
            lambda s=storage: s.read_ranges("k", [(0, n)])[0],  # type: ignore[misc]
        )


if __name__ == "__main__":
    main()
