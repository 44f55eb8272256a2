"""The ``ckptd`` command. Each subcommand is a thin shell over library functions."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd import config
from ckptd.errors import CkptdError
from ckptd.manifest import catalog, decode
from ckptd.manifest import layout as L
from ckptd.storage import open_storage
from ckptd.writer import commit as C
from ckptd.writer import retention

split_ckpt = catalog.split_step_url
open_ckpt = catalog.open_step


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency; degrade quietly
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None, file=sys.stderr)


# ----------------------------------------------------------------------------- commands
def cmd_ls(args: argparse.Namespace) -> int:
    storage = open_storage(args.root, args.storage_options)
    rows: list[dict[str, Any]] = []
    for step in catalog.all_steps(storage):
        try:
            m = decode(storage.read_bytes(L.manifest_path(step)), L.manifest_path(step))
            rows.append(
                {
                    "step": step,
                    "committed": True,
                    "world_size": m.world_size,
                    "nbytes": m.nbytes,
                    "tensors": len(m.tensors),
                    "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)),
                }
            )
        except FileNotFoundError:
            rows.append(
                {
                    "step": step,
                    "committed": False,
                    "world_size": None,
                    "nbytes": None,
                    "tensors": None,
                    "created": None,
                }
            )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(
            _table(
                [
                    [
                        r["step"],
                        "yes" if r["committed"] else "no (incomplete)",
                        r["world_size"] or "",
                        _human(r["nbytes"]) if r["nbytes"] is not None else "",
                        r["tensors"] or "",
                        r["created"] or "",
                    ]
                    for r in rows
                ],
                ["step", "committed", "world", "size", "tensors", "created"],
            )
        )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    storage, step, m = open_ckpt(args.ckpt, args.storage_options)
    if args.json:
        print(json.dumps(m.to_json(), indent=1))
        return 0
    print(f"checkpoint {storage.url}/{L.step_dir(step)}")
    print(
        f"step {m.step}   world size {m.world_size}   attempt {m.attempt}   "
        f"{_human(m.nbytes)} in {len({c.file for t in m.tensors.values() for c in t.chunks})} "
        f"files   saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.created))}"
    )
    rows = []
    for name, t in sorted(m.tensors.items()):
        codecs = sorted({c.codec for c in t.chunks})
        ranks = sorted({c.rank for c in t.chunks})
        rank_s = ",".join(map(str, ranks)) if len(ranks) <= 6 else f"{len(ranks)} ranks"
        rows.append(
            [
                name,
                str(t.dtype).removeprefix("torch."),
                "x".join(map(str, t.shape)) or "()",
                len(t.chunks),
                _human(sum(c.length for c in t.chunks)),
                rank_s,
                "/".join(codecs),
            ]
        )
    print(_table(rows, ["tensor", "dtype", "shape", "chunks", "bytes", "ranks", "codec"]))
    if m.values:
        print("values: " + json.dumps(m.values, sort_keys=True)[:2000])
    if m.training:
        print("training: " + json.dumps(m.training, sort_keys=True)[:2000])
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptd.reshard.verify import verify

    storage, step, m = open_ckpt(args.ckpt, args.storage_options)
    bar = _progress(m.nbytes, "verify")
    with ThreadPoolExecutor(config.io_threads()) as pool:
        report = verify(
            storage, L.step_dir(step), m, pool, progress=bar.update if bar is not None else None
        )
    if bar is not None:
        bar.close()
    out = {
        "step": step,
        "ok": report.ok,
        "tensors": report.tensors,
        "chunks": report.chunks,
        "bytes_read": report.bytes_read,
        "overlaps_checked": report.overlaps_checked,
        "problems": report.problems,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    elif report.ok:
        print(
            f"ok: step {step}: {report.tensors} tensors, {report.chunks} chunks, "
            f"{_human(report.bytes_read)} re-read, {report.overlaps_checked} overlapping "
            "copies agree"
        )
    else:
        for p in report.problems:
            print(f"FAIL: {p}", file=sys.stderr)
    return 0 if report.ok else 1


def cmd_finalize(args: argparse.Namespace) -> int:
    root, step = split_ckpt(args.ckpt)
    storage = open_storage(root, args.storage_options)
    steps = (
        [step]
        if step is not None
        else [s for s in catalog.all_steps(storage) if s not in catalog.committed_steps(storage)]
    )
    done = []
    for s in steps:
        if C.finalize(storage, s) is not None:
            done.append(s)
    if args.json:
        print(json.dumps({"finalized": done}))
    else:
        print(f"finalized steps: {done}" if done else "nothing to finalise")
    if step is not None and not done:
        raise CkptdError(f"{storage.url}/{L.step_dir(step)}: partials incomplete; cannot finalise")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    storage = open_storage(args.root, args.storage_options)
    report = retention.collect_garbage(
        storage, keep_last=args.keep_last, upload_min_age_s=args.upload_min_age
    )
    out = {
        "removed_committed": report.removed_committed,
        "removed_incomplete": report.removed_incomplete,
        "removed_attempts": report.removed_attempts,
        "aborted_uploads": report.aborted_uploads,
    }
    print(
        json.dumps(out)
        if args.json
        else f"removed {len(report.removed_committed)} old committed, "
        f"{len(report.removed_incomplete)} incomplete steps, "
        f"{len(report.removed_attempts)} dead attempts inside kept steps; aborted "
        f"{report.aborted_uploads} incomplete uploads"
    )
    return 0


def storage_options_arg(text: str) -> dict[str, Any]:
    """``--storage-options``: a JSON object, e.g. ``{"client_kwargs": {"endpoint_url": URL}}``."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


_STORAGE_OPTIONS_HELP = (
    'JSON object passed to the fsspec backend, e.g. \'{"client_kwargs": {"endpoint_url": '
    '"http://127.0.0.1:9000"}}\' for an S3-compatible server (accepted before or after the '
    "subcommand)"
)


Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptd", description=__doc__)
    p.add_argument(
        "--storage-options", type=storage_options_arg, default=None, help=_STORAGE_OPTIONS_HELP
    )
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Command, help_: str) -> argparse.ArgumentParser:
        # "resolve": a subcommand may define its own --storage-options, replacing this one
        sp = sub.add_parser(name, help=help_, conflict_handler="resolve")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        # also after the subcommand; SUPPRESS: absent here does not reset a value given before
        sp.add_argument(
            "--storage-options",
            type=storage_options_arg,
            default=argparse.SUPPRESS,
            help=_STORAGE_OPTIONS_HELP,
        )
        sp.set_defaults(fn=fn)
        return sp

    add("ls", cmd_ls, "committed steps, sizes, world sizes").add_argument("root")
    add("inspect", cmd_inspect, "logical tensors, dtypes, shapes, chunks").add_argument("ckpt")
    add("verify", cmd_verify, "re-read every byte; checksums, coverage").add_argument("ckpt")
    add("finalize", cmd_finalize, "commit complete-but-uncommitted steps").add_argument("ckpt")
    gc = add(
        "gc",
        cmd_gc,
        "remove incomplete steps (and old ones with --keep-last); abort abandoned S3 uploads",
    )
    gc.add_argument("root")
    gc.add_argument("--keep-last", type=int, default=0)
    gc.add_argument(
        "--upload-min-age",
        type=float,
        default=None,
        metavar="SECONDS",
        help="abort incomplete multipart uploads (S3) at least this old (default: "
        "CKPTD_GC_UPLOAD_MIN_AGE_S, 3600, or twice the commit timeout if longer; must exceed "
        "the commit timeout); those under removed incomplete steps whatever their age",
    )
    for module in _COMMAND_MODULES:
        importlib.import_module(module).register(sub, add)
    return p


# Subcommands that live next to the library code they drive. Each module has
# ``register(subparsers, add)`` where ``add(name, fn, help) -> ArgumentParser`` adds a
# subcommand with ``--json``; ``fn(args) -> int`` is the exit status.
_COMMAND_MODULES: list[str] = ["ckptd.interop.commands", "ckptd.reshard.commands",
                              "ckptd.elastic.commands"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (CkptdError, OSError, ValueError) as e:
        print(f"ckptd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
