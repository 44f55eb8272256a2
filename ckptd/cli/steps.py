"""``ckptd ls``, ``inspect``, ``verify``, ``finalize`` and ``gc``: the steps under a root."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ckptd import catalog
from ckptd.cli.common import (
    Add,
    add_ckpt,
    ckpt_url,
    human,
    open_ckpt,
    open_root,
    progress,
    resolve_ckpt,
    table,
)
from ckptd.errors import CheckpointNotFound, CkptdError
from ckptd.manifest import layout
from ckptd.manifest.parse import whole_doc
from ckptd.storage import Storage


def register(add: Add) -> None:
    ls = add("ls", cmd_ls, "committed steps, sizes, world sizes (damaged steps flagged)")
    ls.add_argument("root", help="the checkpoint root: a path or fsspec URL")
    ins = add("inspect", cmd_inspect, "logical tensors, dtypes, shapes, chunks, metadata")
    add_ckpt(ins)
    ver = add("verify", cmd_verify,
              "re-read every byte: checksums, coverage, agreement of replicated copies")
    add_ckpt(ver)
    fin = add("finalize", cmd_finalize,
              "commit the root owner's steps whose partials are complete but not committed")
    add_ckpt(fin, "ROOT (every such step), ROOT/step-N or ROOT with --step N")
    gc = add("gc", cmd_gc, "remove what no committed step names and no save can still commit "
                           "(and old steps with --keep-last); abort abandoned S3 uploads")
    gc.add_argument("root", help="the checkpoint root: a path or fsspec URL")
    gc.add_argument("--keep-last", type=int, default=0, metavar="N",
                    help="also remove committed steps beyond the newest N (0: keep all)")
    gc.add_argument(
        "--upload-min-age", type=float, default=None, metavar="SECONDS",
        help="abort incomplete multipart uploads (S3) at least this old (default: "
        "CKPTD_GC_UPLOAD_MIN_AGE_S, 3600, or twice the commit timeout if longer; must exceed "
        "the commit timeout); those under removed attempts whatever their age")


def _row(storage: Storage, step: int) -> dict[str, Any]:
    try:
        h = catalog.read_head(storage, step)
        return {"step": step, "state": "committed", "world_size": h.world_size,
                "nbytes": h.nbytes, "tensors": len(h.tensors), "generation": h.generation,
                "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.created)),
                "problem": None}
    except CheckpointNotFound:
        state, problem = "incomplete", None
    except CkptdError as e:
        state, problem = "damaged", str(e)
    except (ValueError, OverflowError) as e:  # a time no clock shows
        state, problem = "damaged", (f"{storage.url}/{layout.manifest_path(step)}: malformed "
                                     f"manifest ({type(e).__name__}: {e})")
    return {"step": step, "state": state, "world_size": None, "nbytes": None, "tensors": None,
            "generation": None, "created": None, "problem": problem}


def cmd_ls(args: argparse.Namespace) -> int:
    storage = open_root(args.root, args.storage_options)
    rows = [_row(storage, s) for s in catalog.all_steps(storage)]
    good = [r for r in rows if r["state"] == "committed"]
    newest = max(good, key=lambda r: (r["generation"], r["step"]), default=None)
    for r in rows:
        r["latest"] = r is newest
    if args.json:
        print(json.dumps([{**r, "committed": r["state"] == "committed"} for r in rows],
                         indent=1))
    else:
        if not rows:
            print(f"{storage.url}: no steps yet")
        else:
            print(table([[r["step"], r["state"] + (" (latest)" if r["latest"] else ""),
                          r["world_size"] or "", "" if r["nbytes"] is None else human(r["nbytes"]),
                          r["tensors"] or "", r["created"] or ""] for r in rows],
                        ["step", "state", "world", "size", "tensors", "created"]))
        for r in rows:
            if r["problem"]:
                print(f"damaged: {r['problem']}", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.json:  # the document as it is stored, in any format, once its decode checked it
        storage, step = catalog.open_url(ckpt_url(args), args.storage_options)
        raw = catalog.read_raw(storage, step)
        catalog.decode_manifest(storage, step, raw)
        print(json.dumps(whole_doc(raw, layout.manifest_path(step)), indent=1))
        return 0
    storage, step, m = open_ckpt(args)
    print(f"checkpoint {storage.url}/{layout.step_dir(step)}")
    print(
        f"step {m.step}   world size {m.world_size}   attempt {m.attempt}   "
        f"{human(m.nbytes)} in {len({c.file for t in m.tensors.values() for c in t.chunks})} "
        f"files   saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.created))}"
    )
    rows = []
    for name, t in sorted(m.tensors.items()):
        codec_names = sorted({c.codec for c in t.chunks})
        ranks = sorted({c.rank for c in t.chunks})
        rank_s = ",".join(map(str, ranks)) if len(ranks) <= 6 else f"{len(ranks)} ranks"
        rows.append([name, t.dtype_name, "x".join(map(str, t.shape)) or "()",
                     len(t.chunks), human(sum(c.length for c in t.chunks)), rank_s,
                     "/".join(codec_names)])
    print(table(rows, ["tensor", "dtype", "shape", "chunks", "bytes", "ranks", "codec"]))
    if m.values:  # bytes (a dataloader's state) shown by their size
        print("values: " + json.dumps(m.values, sort_keys=True, default=_shown)[:2000])
    if m.training:
        print("training: " + json.dumps(m.training, sort_keys=True)[:2000])
    return 0


def _shown(value: object) -> str:
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    raise TypeError(f"{type(value).__name__} in a manifest's values")


def cmd_verify(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from ckptd import config
    from ckptd.loader.verify import verify

    storage, step, m = open_ckpt(args)
    bar = progress(m.nbytes, "verify")
    try:
        with ThreadPoolExecutor(config.io_threads()) as pool:
            report = verify(storage, layout.step_dir(step), m, pool, progress=bar.update)
    finally:
        bar.close()
    out = {"step": step, "ok": report.ok, "tensors": report.tensors, "chunks": report.chunks,
           "bytes_read": report.bytes_read, "overlaps_checked": report.overlaps_checked,
           "problems": report.problems}
    if args.json:
        print(json.dumps(out, indent=1))
    elif report.ok:
        print(f"ok: step {step}: {report.tensors} tensors, {report.chunks} chunks, "
              f"{human(report.bytes_read)} re-read, {report.overlaps_checked} overlapping "
              "copies agree")
    else:
        for p in report.problems:
            print(f"FAIL: {p}", file=sys.stderr)
    return 0 if report.ok else 1


def cmd_finalize(args: argparse.Namespace) -> int:
    from ckptd.writer import commit

    storage, step = resolve_ckpt(args.ckpt, args.step, args.storage_options, committed=False)
    committed = set(catalog.committed_steps(storage))
    steps = [step] if step is not None else [
        s for s in catalog.all_steps(storage) if s not in committed]
    done = [s for s in steps if commit.finalize(storage, s) is not None]
    if args.json:
        print(json.dumps({"finalized": done}))
    else:
        print(f"finalized steps: {done}" if done else "nothing to finalise")
    if step is not None and not done:
        raise CkptdError(f"{storage.url}/{layout.step_dir(step)}: no complete attempt of the "
                         "root's owner to commit (partials missing, failed, or another run's)")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from ckptd.writer import retention

    storage = open_root(args.root, args.storage_options)
    report = retention.collect_garbage(storage, keep_last=args.keep_last,
                                       upload_min_age_s=args.upload_min_age)
    out = {"removed_committed": report.removed_committed,
           "removed_incomplete": report.removed_incomplete,
           "removed_attempts": report.removed_attempts,
           "aborted_uploads": report.aborted_uploads}
    print(json.dumps(out) if args.json else
          f"removed {len(report.removed_committed)} old committed, "
          f"{len(report.removed_incomplete)} incomplete steps, "
          f"{len(report.removed_attempts)} dead attempts inside kept steps; aborted "
          f"{report.aborted_uploads} incomplete uploads")
    return 0
