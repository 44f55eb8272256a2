"""What every subcommand shares: naming and opening a checkpoint, storage options, tables,
sizes, bars.

Nothing here imports torch: the commands that need it import it when they run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ckptd.errors import CheckpointNotFound, CkptdError

if TYPE_CHECKING:
    from ckptd.manifest.schema import Manifest
    from ckptd.storage import Storage

Command = Callable[[argparse.Namespace], int]
Add = Callable[[str, Command, str], argparse.ArgumentParser]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def progress(total: int | None, desc: str) -> Any:
    """A byte progress bar on stderr (tqdm; off when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None, file=sys.stderr)


def positive_int(text: str) -> int:
    """An argparse type: 1, 2, ... (a world size, a parallel degree)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def step_number(text: str) -> int:
    """An argparse type: a step, 0, 1, 2, ..."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a step number >= 0, got {text!r}")
    return value


# ----------------------------------------------------------------------------- naming a step
SHORT_STEP = re.compile(r"step-(\d{1,8})")  # ckptd writes step-NNNNNNNNN (9 digits or more)
CKPT_HELP = ("ROOT (its latest committed step), ROOT/step-N (step-100 or step-000000100) or "
             "ROOT with --step N; a path or fsspec URL")
STEP_HELP = "step N of ROOT (the same as ROOT/step-N)"


def add_ckpt(parser: argparse.ArgumentParser, help_: str = CKPT_HELP) -> None:
    """The ``CKPT`` argument and its ``--step N``."""
    parser.add_argument("ckpt", help=help_)
    parser.add_argument("--step", type=step_number, metavar="N", help=STEP_HELP)


def split_ckpt(url: str, step: int | None,
               storage_options: dict[str, Any] | None) -> tuple[str, int | None]:
    """``(ROOT, N)`` of ``ROOT/step-N`` (N of any width) or of ``ROOT`` with ``--step N``;
    ``(ROOT, None)`` names the latest committed step. A short name (``step-100``) that is a
    checkpoint root itself stays a root."""
    from ckptd import catalog

    root, named = catalog.split_step_url(url)
    if named is None:
        head, slash, name = root.rpartition("/")
        m = SHORT_STEP.fullmatch(name)
        if m and slash and not _is_root(root, storage_options):
            root, named = head or "/", int(m.group(1))
    if step is not None and named is not None and step != named:
        raise ValueError(f"{url} and --step {step} name different steps: give one of them")
    return root, named if step is None else step


def _is_root(url: str, storage_options: dict[str, Any] | None) -> bool:
    from ckptd.manifest import layout
    from ckptd.storage import open_storage

    names = open_storage(url, storage_options).list_dir("")
    return layout.OWNER in names or any(layout.parse_step_dir(n) is not None for n in names)


def open_root(url: str, storage_options: dict[str, Any] | None) -> Storage:
    """The storage of a ckptd root; a missing path, a file or an unrelated directory is an
    error (a listing of "nothing" would read as "no checkpoints yet")."""
    from ckptd.manifest import layout
    from ckptd.storage import open_storage

    storage = open_storage(url, storage_options)
    names = storage.list_dir("")
    if layout.OWNER in names or any(layout.parse_step_dir(n) is not None for n in names):
        return storage
    if not names and not storage.exists(""):
        raise CheckpointNotFound(f"{storage.url}: no such checkpoint root")
    if "://" not in storage.url:
        import os

        if not os.path.isdir(storage.url):
            raise CkptdError(f"{storage.url}: not a directory (a checkpoint root is one)")
    raise CkptdError(
        f"{storage.url}: not a ckptd checkpoint root (no {layout.OWNER}, no step-* directories)")


def resolve_ckpt(url: str, step: int | None, storage_options: dict[str, Any] | None, *,
                 committed: bool = True) -> tuple[Storage, int | None]:
    """The root's storage and the step a command names (None: the latest). A step that is not
    committed (with ``committed=False``: that has no directory) is an error that says which
    steps there are."""
    from ckptd import catalog
    from ckptd.manifest import layout

    root, step = split_ckpt(url, step, storage_options)
    storage = open_root(root, storage_options)
    if step is None:
        return storage, None
    if not committed:
        if step not in catalog.all_steps(storage):
            raise CheckpointNotFound(f"{storage.url}/{layout.step_dir(step)}: no such step "
                                     f"directory ({_steps_there(storage)})")
        return storage, step
    try:
        catalog.read_committed(storage, step)
    except CheckpointNotFound:
        state = ("not committed" if step in catalog.all_steps(storage) else "no such step")
        raise CheckpointNotFound(f"{storage.url}: step {step}: {state} "
                                 f"({_steps_there(storage)})") from None
    return storage, step


def _steps_there(storage: Storage, shown: int = 5) -> str:
    """The newest committed steps, for an error naming a step that is not there."""
    from ckptd import catalog

    try:
        steps = catalog.committed_steps(storage)
    except CkptdError:  # a damaged manifest: `ckptd ls` shows which
        return f"ckptd ls {storage.url} lists the steps"
    if not steps:
        return "no step is committed there"
    newest = ", ".join(map(str, reversed(steps[-shown:])))
    return (f"committed: {newest}" if len(steps) <= shown else
            f"the newest committed: {newest}; ckptd ls {storage.url} lists all {len(steps)}")


def ckpt_url(args: argparse.Namespace, url: str | None = None) -> str:
    """The checkpoint ``args`` name (``args.ckpt`` or ``url``, ``args.step``), checked, as the
    library reads it: ``ROOT`` or ``ROOT/step-NNNNNNNNN``."""
    from ckptd.manifest import layout

    storage, step = resolve_ckpt(args.ckpt if url is None else url,
                                 getattr(args, "step", None), args.storage_options)
    return storage.url if step is None else f"{storage.url}/{layout.step_dir(step)}"


def open_ckpt(args: argparse.Namespace) -> tuple[Storage, int, Manifest]:
    """Storage, step and decoded manifest of the checkpoint ``args`` name."""
    from ckptd import catalog

    return catalog.open_step(ckpt_url(args), args.storage_options)


def storage_options_arg(text: str) -> dict[str, Any]:
    """``--storage-options``: a JSON object, e.g. ``{"client_kwargs": {"endpoint_url": URL}}``."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


STORAGE_OPTIONS_HELP = (
    'JSON object passed to the fsspec backend, e.g. \'{"client_kwargs": {"endpoint_url": '
    '"http://127.0.0.1:9000"}}\' for an S3-compatible server (accepted before or after the '
    "subcommand)"
)
