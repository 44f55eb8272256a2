"""S3 throughput floor on a local moto server: boto3 and s3fs vs ckptd's S3Storage.

    python benchmarks/s3_floor.py [--mib 256] [--repeat 3] [--sweep]

Starts ``moto.server`` in a subprocess on 127.0.0.1 (port 0), moves one object of ``--mib`` MiB
up and down with each client, and prints the median MB/s of ``--repeat`` rounds (each round runs
every client once; the write through ckptd is fed as 4 MiB buffers, the read is one range).
``--sweep`` also varies S3Storage's part size and concurrency. The moto server is a single
Python process, so these figures measure the clients against *its* ceiling, not against S3.
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
Put = Callable[[str], Any]
Get = Callable[[str], bytes]


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

    from ckptd.storage.s3_storage import S3Storage
    from ckptd.storage.s3_transfer import S3Transfer

    creds: dict[str, Any] = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds)

    def reset() -> None:
        req = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=60).close()
        client.create_bucket(Bucket=BUCKET)

    data = os.urandom(n)
    view = memoryview(data)
    tc = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=16)

    def boto3_download(key: str) -> bytes:
        buf = io.BytesIO()
        client.download_fileobj(BUCKET, key, buf, Config=tc)
        return buf.getvalue()

    options: dict[str, Any] = {
        "key": "testing", "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    clients: list[tuple[str, Put, Get]] = [
        ("boto3 put_object / get_object (1 request)",
         lambda k: client.put_object(Bucket=BUCKET, Key=k, Body=data),
         lambda k: client.get_object(Bucket=BUCKET, Key=k)["Body"].read()),
        ("boto3 TransferManager (16 MiB x 16 threads)",
         lambda k: client.upload_fileobj(io.BytesIO(data), BUCKET, k, Config=tc),
         boto3_download),
        ("s3fs pipe_file / cat_file (50 MiB x 10)",
         lambda k: fs.pipe_file(f"{BUCKET}/{k}", data),
         lambda k: fs.cat_file(f"{BUCKET}/{k}")),
    ]
    configs = [(16, 16), (n >> 20, 1)]
    if sweep:
        configs += [(8, 16), (32, 16), (64, 8), (16, 4), (16, 8), (16, 32)]

    def ckptd_ops(storage: S3Storage) -> tuple[Put, Get]:
        def put(key: str) -> int:
            return storage.write_file(key, (view[i : i + (4 << 20)] for i in range(0, n, 4 << 20)))

        return put, lambda key: storage.read_ranges(key, [(0, n)])[0]

    for part_mib, conc in configs:
        storage = S3Storage(
            f"s3://{BUCKET}", options,
            # the sweep's part size is both the upload part and the ranged-GET unit
            transfer=S3Transfer(part_bytes=part_mib << 20, read_part_bytes=part_mib << 20,
                                concurrency=conc),
        )
        label = "one request" if conc == 1 else f"{part_mib} MiB x {conc}"
        clients.append((f"ckptd S3Storage ({label})", *ckptd_ops(storage)))

    reset()
    # Rounds interleave the clients, so that load drifting on a shared machine hits all alike.
    times: dict[str, list[list[float]]] = {name: [[], [], [], []] for name, _, _ in clients}
    for r in range(repeat):
        for i, (name, put, get) in enumerate(clients):
            key = f"obj-{i}"
            t0, c0 = time.perf_counter(), time.process_time()
            put(key)
            t1, c1 = time.perf_counter(), time.process_time()
            got = get(key)
            t2, c2 = time.perf_counter(), time.process_time()
            if r == 0 and got != data:
                raise SystemExit(f"{name}: read back {len(got)} bytes that differ from the put")
            client.delete_object(Bucket=BUCKET, Key=key)
            measured = (t1 - t0, t2 - t1, c1 - c0, c2 - c1)
            for column, value in zip(times[name], measured, strict=True):
                column.append(value)
    # client CPU: seconds of CPU (all threads of this process; the server is another process)
    # per GiB moved, i.e. the client's own ceiling on one core is 1.07 / that figure GB/s.
    print(f"{'':<46}     {'MB/s':>7}     {'MB/s':>7}   client CPU s/GiB (put, get)")
    for name, columns in times.items():
        put_s, get_s, put_cpu, get_cpu = (statistics.median(c) for c in columns)
        print(
            f"{name:<46} put {n / put_s / 1e6:7.1f}  get {n / get_s / 1e6:7.1f}   "
            f"{put_cpu * (1 << 30) / n:5.2f} {get_cpu * (1 << 30) / n:5.2f}",
            flush=True,
        )

if __name__ == "__main__":
    main()
