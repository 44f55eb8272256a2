"""``ckptd export`` and ``ckptd import-dcp``: thin shells over ``ckptd.interop``."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from ckptd.cli.common import Add, add_ckpt, ckpt_url, human, progress

SHARD_DEFAULT = "50GB"


@contextlib.contextmanager
def _bar(desc: str) -> Iterator[Any]:
    bar = progress(0, desc)
    try:
        yield bar
    finally:
        bar.close()


def cmd_export(args: argparse.Namespace) -> int:
    if args.format == "dcp":
        from ckptd.interop.dcp_export import export_dcp

        unusable = [
            f"--{o.replace('_', '-')}"
            for o in ("select", "strip_prefix", "dtype", "fuse", "config", "config_from",
                      "no_config", "keep_wrapper_names", "rename", "overwrite")
            if getattr(args, o)
        ]
        if unusable or args.max_shard_size != SHARD_DEFAULT:
            raise ValueError(f"{', '.join(unusable) or '--max-shard-size'}: safetensors only")
        with _bar("export") as bar:
            report: Any = export_dcp(
                ckpt_url(args), args.out, storage_options=args.storage_options, progress=bar.update
            )
        summary = (
            f"wrote {report.items} items of {report.tensors} tensors ({human(report.nbytes)}) "
            f"of step {report.step} to {report.url}"
            + (
                f"; left out {report.skipped_locals} per-rank values"
                if report.skipped_locals
                else ""
            )
        )
    else:
        from ckptd.interop.safetensors_export import export_safetensors

        with _bar("export") as bar:
            report = export_safetensors(
                ckpt_url(args),
                args.out,
                select=args.select,
                strip_prefix=args.strip_prefix,
                max_shard_size=args.max_shard_size,
                dtype=args.dtype,
                fuse=args.fuse or (),
                storage_options=args.storage_options,
                progress=bar.update,
                config=args.config,
                config_from=args.config_from,
                no_config=args.no_config,
                keep_wrappers=args.keep_wrapper_names,
                rename=args.rename,
                overwrite=args.overwrite,
            )
        summary = (
            f"wrote {report.tensors} tensors ({human(report.total_size)}) of step {report.step} "
            f"in {len(report.files)} files + model.safetensors.index.json"
            + (" + config.json" if report.config else " (no config.json)")
            + f" to {report.url}"
            + (f"; removed wrapper segments (_orig_mod, module, ...) from {report.stripped} "
               "names" if report.stripped else "")
            + (f"; renamed {report.renamed}" if report.renamed else "")
        )
    print(json.dumps(asdict(report)) if args.json else summary)
    return 0


def cmd_import_dcp(args: argparse.Namespace) -> int:
    from ckptd.interop.dcp_import import import_dcp

    with _bar("import") as bar:
        report = import_dcp(
            args.src,
            args.out,
            trust=args.trust,
            step=args.step,
            compression=args.compression,
            storage_options=args.storage_options,
            progress=bar.update,
        )
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print(
            f"imported {report.tensors} tensors and {report.values} values as step "
            f"{report.step} (from {report.step_from}): {report.url} ({human(report.nbytes)})"
            + (f"; skipped objects that are not values (class instances) {report.skipped}"
               if report.skipped else "")
        )
    return 0


def register(add: Add) -> None:
    ex = add("export", cmd_export, "write a checkpoint as safetensors (Hugging Face) or DCP")
    add_ckpt(ex)
    ex.add_argument("--format", choices=["safetensors", "dcp"], required=True,
                    help="safetensors (Hugging Face: whole tensors, consolidated from every "
                    "rank, in shards + index + config.json) or dcp")
    ex.add_argument("--out", required=True, help="output directory (path or URL)")
    ex.add_argument(
        "--select",
        action="append",
        metavar="GLOB",
        help="logical tensors to export (repeatable; default the model's: 'model/*' with "
        "model/ stripped, or all but optimizer, scheduler, dataloader and per-rank state)",
    )
    ex.add_argument("--strip-prefix", metavar="PREFIX", help="removed from names, e.g. model/")
    ex.add_argument("--max-shard-size", default=SHARD_DEFAULT,
                    help=f"per file (default {SHARD_DEFAULT}, as transformers writes)")
    ex.add_argument("--config", metavar="FILE", help="the model's config.json, written beside")
    ex.add_argument("--config-from", metavar="DIR",
                    help="a model directory whose config.json is written beside")
    ex.add_argument("--no-config", action="store_true",
                    help="write no config.json (from_pretrained then needs one from elsewhere)")
    ex.add_argument("--keep-wrapper-names", action="store_true",
                    help="keep _orig_mod, module, _checkpoint_wrapped_module, "
                    "_fsdp_wrapped_module segments (removed by default)")
    ex.add_argument("--rename", metavar="MODULE:FUNC|FILE.json",
                    help="map each output name: a Python function name -> name, or a JSON "
                    "object of names (a framework's state-dict adapter)")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export in --out (a non-empty --out is refused)")
    ex.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16, fp32")
    ex.add_argument(
        "--fuse",
        action="append",
        metavar="T=A,B[,..][@DIM]",
        help="write parts A, B.. concatenated along DIM as T ('*' matches any text)",
    )
    im = add("import-dcp", cmd_import_dcp, "convert a torch.distributed.checkpoint directory")
    im.add_argument("src", help="the DCP directory (holds .metadata)")
    im.add_argument("--out", required=True, help="the ckptd root to write the step into")
    im.add_argument(
        "--trust",
        action="store_true",
        help="allow unpickling DCP's .metadata (it can run code: trusted sources only)",
    )
    im.add_argument(
        "--step",
        type=int,
        default=None,
        help="step number (default: N of a step-N directory name, else the checkpoint's "
        "train_state.step or step value, else 0)",
    )
    im.add_argument("--compression", default=None, help="zstd or zstd:LEVEL")
