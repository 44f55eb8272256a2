"""The ``ckptd`` command: each subcommand is a thin shell over the library.

Arguments are parsed before anything heavy is imported: ``ckptd --help``, ``ckptd ls`` and
``ckptd plan`` never import torch; the commands that read tensors import it when they run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ckptd import __version__, config
from ckptd.cli import agent, elastic, interop, reshard, steps
from ckptd.cli.common import STORAGE_OPTIONS_HELP, Command, storage_options_arg
from ckptd.errors import CkptdError

DESCRIPTION = """\
Checkpoints of distributed PyTorch training that do not belong to a world size: list, inspect,
verify, reshard, export and garbage-collect them, and plan elastic batch settings. CKPT is a
checkpoint root (meaning its latest committed step) or ROOT/step-NNNNNNNNN; ROOT is a local path
or an fsspec URL (s3://bucket/prefix). Every command prints a one-line reason and exits non-zero
on bad input, and takes --json where a machine reads the output."""

EPILOG = "docs/guide.md has the library; set CKPTD_DEBUG=1 to see a traceback on an error."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptd", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    p.add_argument("--storage-options", type=storage_options_arg, default=None,
                   help=STORAGE_OPTIONS_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Command, help_: str) -> argparse.ArgumentParser:
        # "resolve": a subcommand may define its own --storage-options, replacing this one
        sp = sub.add_parser(name, help=help_, description=help_, conflict_handler="resolve")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        # also after the subcommand; SUPPRESS: absent here does not reset a value given before
        sp.add_argument("--storage-options", type=storage_options_arg, default=argparse.SUPPRESS,
                        help=STORAGE_OPTIONS_HELP)
        sp.set_defaults(fn=fn)
        return sp

    for group in (steps, reshard, elastic, interop, agent):
        group.register(add)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except BrokenPipeError:  # `ckptd inspect CKPT | head`: the reader has seen enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        return 1
    except KeyboardInterrupt:
        print(f"ckptd {args.command}: interrupted", file=sys.stderr)
        return 130
    except (CkptdError, OSError, ValueError) as e:
        if config.DEBUG.get():
            raise
        print(f"ckptd {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug: still one line, and how to see more
        if config.DEBUG.get():
            raise
        print(f"ckptd {args.command}: internal error: {type(e).__name__}: {_one_line(e)} "
              "(set CKPTD_DEBUG=1 for the traceback)", file=sys.stderr)
        return 3


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__

