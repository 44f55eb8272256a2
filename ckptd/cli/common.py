"""What every subcommand shares: opening a checkpoint, storage options, tables, sizes, bars.

Nothing here imports torch: the commands that need it import it when they run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

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


def open_ckpt(url: str, storage_options: dict[str, Any] | None) -> tuple[Storage, int, Manifest]:
    """Storage, step and decoded manifest of ``ROOT`` (its latest step) or ``ROOT/step-N``."""
    from ckptd import catalog

    return catalog.open_step(url, storage_options)


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
CKPT_HELP = "ROOT (its latest committed step) or ROOT/step-NNNNNNNNN; a path or fsspec URL"
