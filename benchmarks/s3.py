"""ckptd on S3 (a local moto server) vs torch.distributed.checkpoint's fsspec writer and reader,
next to the floor: the same bytes as one object through boto3 and through s3fs.

    python benchmarks/s3.py [--size 512MiB] [--runs 3] [--json out.json] [--md FILE]

Starts ``moto.server`` in its own process on 127.0.0.1 (port 0; all traffic stays on loopback),
builds one rank's training state of ``--size`` (bf16 model + fp32 master, exp_avg, exp_avg_sq:
``benchmarks/common.build_state``), then runs ``--runs`` rounds. A round runs every contestant
once, interleaved, so that load drifting on a shared machine hits all alike, on a server reset at
the start of the round. Each contestant puts, then gets back what it put:

- floor: the state's bytes as one object: ``put_object``/``get_object`` (one request each) and
  ``upload_fileobj``/``download_fileobj`` (TransferManager, 16 MiB x 16 threads) through boto3,
  ``pipe_file``/``cat_file`` through s3fs. The floor is the best of these medians.
- ckptd: ``Checkpointer.save`` (call to committed: the manifest PUT returned), then ``load``
  into a zeroed copy of the state by a fresh Checkpointer (as after a restart); defaults.
- DCP: ``dcp.save`` with ``FsspecWriter``, ``dcp.load`` with ``FsspecReader``, same bucket and
  ``storage_options``; DCP's default ``thread_count=1``, and ``thread_count`` = ckptd's threads.

Prints a markdown table (median MB/s of the rounds with the min-max range, ratios to the floor
and to DCP, client CPU seconds per GiB); ``--json`` writes every round's raw figures and the
machine, ``--md`` the table and notes. Every read-back is checked bit-exact in the first round.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_state, fmt_bytes, machine_info, parse_size  # noqa: E402

_MOTO_MAIN = """
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server
server = make_server("127.0.0.1", 0, DomainDispatcherApplication(create_backend_app), threaded=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"""
BUCKET = "bench"


def log(msg: str) -> None:
    print(f"[s3 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Moto:
    """moto.server in a child process on 127.0.0.1, port 0 (the child prints its port)."""

    def __init__(self) -> None:
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _MOTO_MAIN],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        self.endpoint = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def reset(self, client: Any) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=300).close()
        client.create_bucket(Bucket=BUCKET)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


# ----------------------------------------------------------------------------- state helpers


def flat_bytes(tree: Any) -> bytes:
    """The state's tensors, concatenated: the floor moves exactly the checkpoint's bytes."""
    leaves: list[torch.Tensor] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, torch.Tensor):
            leaves.append(node.contiguous().view(-1).view(torch.uint8))

    walk(tree)
    return torch.cat(leaves).numpy().tobytes()


def zeros_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return tree


def zero_(tree: Any) -> None:
    if isinstance(tree, dict):
        for v in tree.values():
            zero_(v)
    elif isinstance(tree, torch.Tensor):
        tree.zero_()


def same(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return all(same(got[k], want[k]) for k in want)
    if isinstance(want, torch.Tensor):
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if isinstance(want, (bytes, bytearray, memoryview)):
        return bytes(got) == bytes(want)
    return bool(got == want)


# ----------------------------------------------------------------------------- contestants


@dataclass
class Contestant:
    """``put(r)`` and ``get(r)`` return the timed operation (a no-argument callable) after doing
    their untimed setup: what a training job does once (construct a Checkpointer, fault in its
    staging memory; construct DCP's writer), not at every save. The get's operation returns what
    it read, checked against what was put in the first round."""

    name: str
    kind: str  # "floor", "ckptd" or "dcp"
    put: Callable[[int], Callable[[], Any]]
    get: Callable[[int], Callable[[], Any]]
    note: str = ""


def contestants(endpoint: str, state: dict[str, Any], data: bytes) -> list[Contestant]:
    import boto3
    import s3fs
    import torch.distributed.checkpoint as dcp
    from boto3.s3.transfer import TransferConfig
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import ckptd
    from ckptd.storage.s3_storage import S3Storage
    from ckptd.storage.s3_transfer import S3Transfer

    options: dict[str, Any] = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    tc = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=16)
    dst = zeros_like(state)

    def tm_get() -> Any:
        buf = io.BytesIO()
        client.download_fileobj(BUCKET, "tm", buf, Config=tc)
        return buf.getbuffer()

    def ckptd_pair(
        root: str, read_part_bytes: int | None = None
    ) -> tuple[Callable[[int], Callable[[], Any]], Callable[[int], Callable[[], Any]]]:
        def put(r: int) -> Callable[[], Any]:
            ck = ckptd.Checkpointer(f"s3://{BUCKET}/{root}", storage_options=options,
                                    keep_last=0)
            ck.reserve(state)

            def op() -> None:
                ck.save(state)
                ck.close()

            return op

        def get(r: int) -> Callable[[], Any]:
            zero_(dst)
            storage = None
            if read_part_bytes is not None:  # the variant: only the GET size differs
                transfer = dataclasses.replace(S3Transfer.from_env(),
                                               read_part_bytes=read_part_bytes)
                storage = S3Storage(f"s3://{BUCKET}/{root}", options, transfer=transfer)
            ck = ckptd.Checkpointer(f"s3://{BUCKET}/{root}", storage_options=options,
                                    storage=storage, keep_last=0)

            def op() -> Any:
                ck.load(dst)
                ck.close()
                return dst

            return op

        return put, get

    def dcp_pair(
        threads: int,
    ) -> tuple[Callable[[int], Callable[[], Any]], Callable[[int], Callable[[], Any]]]:
        url = f"s3://{BUCKET}/dcp{threads}"

        def put(r: int) -> Callable[[], Any]:
            writer = FsspecWriter(url, thread_count=threads, **options)
            return lambda: dcp.save(state, storage_writer=writer)

        def get(r: int) -> Callable[[], Any]:
            zero_(dst)
            reader = FsspecReader(url, **options)

            def op() -> Any:
                dcp.load(dst, storage_reader=reader)
                return dst

            return op

        return put, get

    threads = ckptd.Checkpointer.threads_for(None)
    out = [
        Contestant(
            "boto3 put_object / get_object (1 request)",
            "floor",
            lambda r: lambda: client.put_object(Bucket=BUCKET, Key="boto3", Body=data),
            lambda r: lambda: client.get_object(Bucket=BUCKET, Key="boto3")["Body"].read(),
        ),
        Contestant(
            "boto3 TransferManager (16 MiB x 16)",
            "floor",
            lambda r: lambda: client.upload_fileobj(io.BytesIO(data), BUCKET, "tm", Config=tc),
            lambda r: tm_get,
        ),
        Contestant(
            "s3fs pipe_file / cat_file",
            "floor",
            lambda r: lambda: fs.pipe_file(f"{BUCKET}/s3fs", data),
            lambda r: lambda: fs.cat_file(f"{BUCKET}/s3fs"),
        ),
        Contestant("**ckptd** (defaults)", "ckptd", *ckptd_pair("ckptd")),
        Contestant(
            "ckptd, 16 MiB GETs (not the default)",
            "variant",
            *ckptd_pair("ckptd16", read_part_bytes=16 << 20),
            note="S3Transfer read_part_bytes=16 MiB instead of 64 MiB: 4 ranged GETs per 64 MiB "
            "data object instead of 1, the fan-out a single small rank would want on S3",
        ),
        Contestant("DCP FsspecWriter/Reader, thread_count=1 (default)", "dcp", *dcp_pair(1)),
    ]
    if threads != 1:
        out.append(
            Contestant(
                f"DCP FsspecWriter/Reader, thread_count={threads}", "dcp", *dcp_pair(threads)
            )
        )
    return out


# ----------------------------------------------------------------------------- run & report


def run(args: argparse.Namespace) -> dict[str, Any]:
    import boto3

    machine = machine_info(None)  # before the runs: its load average is the starting one
    log(f"building a {fmt_bytes(args.size)} state")
    st = build_state(args.size)
    state = st.plain()
    data = flat_bytes(state)
    nbytes = len(data)
    log(f"state: {st.ntensors} tensors, {fmt_bytes(nbytes)}; starting moto")
    moto = Moto()
    try:
        client = boto3.client(
            "s3",
            endpoint_url=moto.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        field = contestants(moto.endpoint, state, data)
        rounds: list[dict[str, Any]] = []
        for r in range(args.runs):
            moto.reset(client)
            load = os.getloadavg()[0]
            figures: dict[str, Any] = {"loadavg": load}
            for c in field:
                put = c.put(r)
                t0, c0 = time.perf_counter(), time.process_time()
                put()
                t1, c1 = time.perf_counter(), time.process_time()
                get = c.get(r)
                t2, c2 = time.perf_counter(), time.process_time()
                got = get()
                t3, c3 = time.perf_counter(), time.process_time()
                if r == 0 and not same(got, data if c.kind == "floor" else state):
                    raise SystemExit(f"{c.name}: read back differs from what was put")
                del got, get, put
                figures[c.name] = {
                    "put_s": t1 - t0,
                    "get_s": t3 - t2,
                    "put_cpu_s": c1 - c0,
                    "get_cpu_s": c3 - c2,
                }
                log(
                    f"round {r + 1}/{args.runs} (load {load:.1f}): {c.name}: put "
                    f"{nbytes / (t1 - t0) / 1e6:.0f} MB/s, get {nbytes / (t3 - t2) / 1e6:.0f} MB/s"
                )
            rounds.append(figures)
    finally:
        moto.close()
    return {
        "nbytes": nbytes,
        "tensors": st.ntensors,
        "contestants": [{"name": c.name, "kind": c.kind, "note": c.note} for c in field],
        "rounds": rounds,
        "machine": machine,
        "loadavg_at_end": os.getloadavg(),
    }


def summarize(res: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    n = res["nbytes"]
    rows: dict[str, dict[str, Any]] = {}
    for c in res["contestants"]:
        entry: dict[str, Any] = {"kind": c["kind"], "note": c.get("note", "")}
        for op in ("put", "get"):
            mbps = [n / rnd[c["name"]][f"{op}_s"] / 1e6 for rnd in res["rounds"]]
            cpu = [rnd[c["name"]][f"{op}_cpu_s"] * (1 << 30) / n for rnd in res["rounds"]]
            entry[op] = {
                "median": statistics.median(mbps),
                "min": min(mbps),
                "max": max(mbps),
                "cpu_s_per_gib": statistics.median(cpu),
            }
        rows[c["name"]] = entry
    floor = {
        op: max((e[op]["median"], k) for k, e in rows.items() if e["kind"] == "floor")
        for op in ("put", "get")
    }
    dcp = {
        op: max((e[op]["median"], k) for k, e in rows.items() if e["kind"] == "dcp")
        for op in ("put", "get")
    }
    lines = [
        "| client | save / put MB/s | load / get MB/s | × floor (save, load) | "
        "× best DCP (save, load) | client CPU s/GiB (save, load) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, e in rows.items():
        p, g = e["put"], e["get"]
        ratio_floor = f"{p['median'] / floor['put'][0]:.2f}, {g['median'] / floor['get'][0]:.2f}"
        ratio_dcp = (
            f"{p['median'] / dcp['put'][0]:.2f}, {g['median'] / dcp['get'][0]:.2f}"
            if e["kind"] != "floor"
            else ""
        )
        lines.append(
            f"| {name} | {p['median']:.0f} ({p['min']:.0f}–{p['max']:.0f}) | "
            f"{g['median']:.0f} ({g['min']:.0f}–{g['max']:.0f}) | {ratio_floor} | {ratio_dcp} | "
            f"{p['cpu_s_per_gib']:.1f}, {g['cpu_s_per_gib']:.1f} |"
        )
    ck = next(e for e in rows.values() if e["kind"] == "ckptd")
    targets = {
        "save >= 0.8 x put floor": ck["put"]["median"] / floor["put"][0] / 0.8,
        "save >= 2 x DCP": ck["put"]["median"] / dcp["put"][0] / 2,
        "load >= 0.8 x get floor": ck["get"]["median"] / floor["get"][0] / 0.8,
        "load >= 5 x DCP": ck["get"]["median"] / dcp["get"][0] / 5,
    }
    loads = [rnd["loadavg"] for rnd in res["rounds"]]
    notes = [
        f"{fmt_bytes(n)} in {res['tensors']} tensors; median of {len(res['rounds'])} rounds "
        f"(min–max in brackets); load average {min(loads):.1f}–{max(loads):.1f} at round starts.",
        f"Floor: put {floor['put'][0]:.0f} MB/s ({floor['put'][1]}), get "
        f"{floor['get'][0]:.0f} MB/s ({floor['get'][1]}). Best DCP: save {dcp['put'][0]:.0f} "
        f"MB/s ({dcp['put'][1]}), load {dcp['get'][0]:.0f} MB/s ({dcp['get'][1]}).",
        "Targets for ckptd (defaults), achieved fraction: "
        + "; ".join(f"{k}: {v:.2f}" + (" (met)" if v >= 1 else " (missed)")
                    for k, v in targets.items()) + ".",
    ]
    notes += [f"{k}: {e['note']}." for k, e in rows.items() if e["note"]]
    summary = {
        "rows": rows,
        "floor": {k: v[0] for k, v in floor.items()},
        "floor_client": {k: v[1] for k, v in floor.items()},
        "best_dcp": {k: v[0] for k, v in dcp.items()},
        "targets_fraction": targets,
    }
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {x}" for x in notes) + "\n", summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="write every round's raw figures here")
    ap.add_argument("--md", help="write the table and notes here (markdown)")
    args = ap.parse_args()
    res = run(args)
    table, summary = summarize(res)
    res["summary"] = summary
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.md:
        m = res["machine"]
        import boto3
        import botocore
        import moto
        import s3fs

        versions = (
            f"moto {moto.__version__} (its own process, objects above 5 MiB spooled to /tmp), "
            f"boto3 {boto3.__version__}, botocore {botocore.__version__}, s3fs {s3fs.__version__}"
        )
        with open(args.md, "w") as f:
            f.write(
                f"{table}\nMachine: {m['nproc']} CPUs ({m['cpu']}), Python {m['python']}, torch "
                f"{m['torch']}, {m.get('ckptd', '')} ({m.get('git', '')}); {versions}; load "
                f"average {m['loadavg_at_start'][0]:.1f} at the start, "
                f"{res['loadavg_at_end'][0]:.1f} at the end.\n"
            )


if __name__ == "__main__":
    main()
