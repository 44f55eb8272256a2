"""The ``ckptd`` command: each subcommand is a thin shell over the library.

Arguments are parsed before anything heavy is imported: ``ckptd --help``, ``ckptd ls`` and
``ckptd plan`` never import torch; the commands that read tensors import it when they run.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Sequence

from ckptd import __version__, config
from ckptd.cli import agent, elastic, interop, reshard, steps
from ckptd.cli.common import STORAGE_OPTIONS_HELP, Command, storage_options_arg
from ckptd.errors import CkptdError

DESCRIPTION = """\
Checkpoints of distributed PyTorch training that do not belong to a world size: list, inspect,
verify, reshard, export and garbage-collect them, and plan elastic batch settings. CKPT is a
checkpoint root (meaning its latest committed step), ROOT/step-N (step-100 or step-000000100)
or ROOT with --step N; ROOT is a local path or an fsspec URL (s3://bucket/prefix). Every
command takes --json where a machine reads the output."""

EPILOG = """\
Exit status: 0 done (also when standard output is closed early, as by `ckptd ls ROOT | head
-1`: the command stops quietly); 2 an error, in one line on stderr (bad input, no such
checkpoint, damaged bytes, storage refused); 3 a bug in ckptd, in one line with how to see its
traceback (set CKPTD_DEBUG=1); 130 interrupted. docs/guide.md has the library."""


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
        code = int(args.fn(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError as e:
        if _stdout_closed():  # `ckptd ls ROOT | head -1`: the reader has seen enough
            return 0
        error: Exception = e  # another pipe or socket: an error like any other
    except KeyboardInterrupt:
        print(f"ckptd {args.command}: interrupted", file=sys.stderr)
        return 130
    except (CkptdError, OSError, ValueError) as e:
        error = e
    except Exception as e:  # noqa: BLE001 - a bug: still one line, and how to see more
        if config.DEBUG.get():
            raise
        print(f"ckptd {args.command}: internal error: {type(e).__name__}: {_one_line(e)} "
              "(set CKPTD_DEBUG=1 for the traceback)", file=sys.stderr)
        return 3
    if config.DEBUG.get():
        raise error
    print(f"ckptd {args.command}: error: {_one_line(error)}", file=sys.stderr)
    return 2


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader went away (poll reports an error on a
    pipe's write end once it has no reader). If so, it now points at /dev/null: what is still
    buffered for it goes there when the interpreter flushes at exit, instead of raising a
    second BrokenPipeError."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's capture)
        return False
    poll = select.poll()
    poll.register(fd, 0)  # POLLERR is always reported
    if not any(events & select.POLLERR for _, events in poll.poll(0)):
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return True


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__

