"""``ckptd reshard`` and ``ckptd layout``: a checkpoint rewritten for a planned new world."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from ckptd.cli.common import (
    Add,
    add_ckpt,
    ckpt_url,
    human,
    open_ckpt,
    positive_int,
    progress,
    table,
)

if TYPE_CHECKING:
    from ckptd.elastic.resharder import RankReport


def register(add: Add) -> None:
    r = add("reshard", cmd_reshard, "rewrite a checkpoint packed per rank of a target world")
    add_ckpt(r)
    r.add_argument("--to-world", type=positive_int, required=True, metavar="N",
                   help="the world size to pack the checkpoint for")
    r.add_argument("--tp", type=positive_int,
                   help="tensor-parallel size (overrides the layout file)")
    r.add_argument("--pp", type=positive_int,
                   help="pipeline-parallel size (overrides the layout file)")
    r.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage (default: the layout file's, else the re-planned one)")
    r.add_argument("--layout", metavar="FILE", help="layout file (default: inferred, as "
                   "`ckptd layout` writes it)")
    r.add_argument("--out", metavar="DEST", help="root URL of the new checkpoint")
    r.add_argument("--out-storage-options", type=json.loads, default=None,
                   help="JSON dict for DEST's fsspec backend (default: --storage-options)")
    r.add_argument("--dry-run", action="store_true",
                   help="print per target rank: bytes to read, ranges, peak memory")
    r.add_argument("--threads", type=int, help="worker threads (default: ckptd's io threads)")
    r.add_argument("--budget", type=int, metavar="BYTES",
                   help="host memory for data (default: the load budget)")
    r.add_argument("--compression", default="same", help="same | none | zstd[:LEVEL]")
    r.add_argument("--mem-limit-gib", type=float, help="re-plan: memory per GPU")
    r.add_argument("--max-micro-batch-size", type=int, help="re-plan: largest micro-batch")
    r.add_argument("--tolerance", type=float, help="re-plan: global batch band (default 0.10)")
    lay = add("layout", cmd_layout, "write a starting layout file for `reshard --layout`")
    add_ckpt(lay)
    lay.add_argument("--tp", type=positive_int, default=1,
                     help="tensor-parallel size (default 1)")
    lay.add_argument("--pp", type=positive_int, default=1,
                     help="pipeline-parallel size (default 1)")
    lay.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                     help="ZeRO stage (default 0)")
    lay.add_argument("--world", type=positive_int,
                     help="check the layout against this world size")
    lay.add_argument("--out", metavar="FILE", help="default: standard output")
    lay.add_argument("--format", choices=("toml", "json"),
                     help="default: from --out's extension, else toml")


def cmd_layout(args: argparse.Namespace) -> int:
    from ckptd.loader.infer import infer_layout
    from ckptd.loader.layout_file import dumps
    from ckptd.loader.targets import Resolver

    storage, step, manifest = open_ckpt(args)
    spec = infer_layout(manifest, args.tp, args.pp, args.zero)
    fmt = args.format or ("json" if (args.out or "").endswith(".json") else "toml")
    header = (f"ckptd layout inferred from {storage.url} step {step} for tp {args.tp}, pp "
              f"{args.pp}, ZeRO {args.zero}: review every rule (notes say why) before use.")
    if args.world:
        Resolver(spec, manifest, args.world)  # raises naming the tensor and rule
    text = dumps(spec, fmt, header)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}: {len(spec.rules)} rules", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    """The process does nothing else: no cyclic collection while it decodes, plans and moves
    ~50,000 pieces at --to-world 1024 (their objects hold no cycles; benchmarks/README.md)."""
    from ckptd import gcpause

    with gcpause.paused():
        return _reshard(args)


def _reshard(args: argparse.Namespace) -> int:
    from ckptd.elastic.reshard import plan_reshard

    if not args.dry_run and not args.out:
        raise ValueError("--out DEST is required (or --dry-run)")
    plan = plan_reshard(ckpt_url(args), args.to_world, tp=args.tp, pp=args.pp, zero=args.zero,
                        layout=args.layout, storage_options=args.storage_options,
                        threads=args.threads, budget=args.budget,
                        compression=args.compression, mem_limit_gib=args.mem_limit_gib,
                        max_micro_batch_size=args.max_micro_batch_size,
                        tolerance=args.tolerance)
    bar = progress(plan.total_bytes, "plan" if args.dry_run else "reshard")
    try:
        r = (plan.dry_run(bar.update) if args.dry_run else
             plan.run(args.out, args.out_storage_options, bar.update))
    finally:
        bar.close()
    if r.replanned is not None:
        print(r.replanned.table, file=sys.stderr if args.json else sys.stdout)
    if r.zero_from not in ("", "given", "re-planned"):
        print(r.zero_from, file=sys.stderr if args.json else sys.stdout)
    out: dict[str, Any] = {"dry_run": r.dry_run}
    if not r.dry_run:
        out.update(url=r.url, attempt=r.attempt, nbytes=r.nbytes,
                   source_bytes_read=r.source_bytes_read)
    out.update(step=r.step, world_size=r.world_size, tp=r.tp, pp=r.pp, zero=r.zero,
               zero_from=r.zero_from, ranks=[rep.to_json() for rep in r.reports])
    if r.replanned is not None:
        out["training_spec"] = r.replanned.training["spec"]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        _print_reports(r.reports, r.dry_run)
        if not r.dry_run:
            print(f"read {human(r.source_bytes_read)} from the source (a block cache "
                  "serves the frames several target ranks share)")
            stage = ("FSDP2 dim-0 shards" if r.zero_from.startswith("layout from the source")
                     else f"ZeRO {r.zero}")
            print(f"committed {r.url}: world {r.world_size} (tp {r.tp}, pp {r.pp}, "
                  f"dp {r.dp}, {stage}), {human(r.nbytes)}")
    return 0


def _print_reports(reports: list[RankReport], dry_run: bool) -> None:
    rows = [[r.rank, r.pieces, human(r.hold_bytes), human(r.write_bytes), human(r.read_bytes),
             r.ranges, human(r.peak_bytes)] + ([r.restart_ranges] if dry_run else [])
            for r in reports]
    print(table(rows, ["rank", "pieces", "holds", "writes", "reads", "ranges", "peak memory"]
                + (["ranges from the original"] if dry_run else [])))
    print(f"total: {'would read' if dry_run else 'read'} "
          f"{human(sum(r.read_bytes for r in reports))} in "
          f"{sum(r.ranges for r in reports)} ranges, "
          f"{'would write' if dry_run else 'wrote'} {human(sum(r.write_bytes for r in reports))}"
          + (f"; a restart on the original would read "
             f"{sum(r.restart_ranges for r in reports)} ranges" if dry_run else ""))
