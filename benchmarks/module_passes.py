"""Which ckptd modules a save_async(...).result() and a load(...) pass through (every thread),
and how often the path returns to a module it had already left: a measure of how scattered
the save and load paths are (issue 11). Consecutive calls inside one module count once. The
in-process save path (``agent=False``): with the node agent the save's writing happens in
another process, which this cannot trace.

    python benchmarks/module_passes.py          # by module
    PKG=1 python benchmarks/module_passes.py    # by package

To compare with another commit: ``git archive <commit> ckptd | tar -x -C /tmp/old`` and run
with ``PYTHONPATH=/tmp/old`` (with ckptd not installed in editable mode).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

import ckptd

BY_PACKAGE = os.environ.get("PKG") == "1"
_recording: dict[str, Any] = {"on": False, "seq": []}
_lock = threading.Lock()


def _profile(frame: Any, event: str, arg: Any) -> None:
    if event != "call" or not _recording["on"]:
        return
    mod = frame.f_globals.get("__name__", "")
    if not mod.startswith("ckptd"):
        return
    if BY_PACKAGE:
        mod = ".".join(mod.split(".")[:2])
    with _lock:
        seq = _recording["seq"]
        if not seq or seq[-1] != mod:
            seq.append(mod)


def trace(fn: Callable[[], object]) -> tuple[list[str], int, int]:
    """(modules visited, module transitions, returns to a module already left)."""
    _recording["seq"] = seq = []
    _recording["on"] = True
    try:
        fn()
    finally:
        _recording["on"] = False
    seen: set[str] = set()
    returns = 0
    for i, mod in enumerate(seq):
        if mod in seen and seq[i - 1] != mod:
            returns += 1
        seen.add(mod)
    return sorted(seen), len(seq), returns


def report(what: str, result: tuple[list[str], int, int]) -> None:
    mods, transitions, returns = result
    print(f"{what}: {len(mods)} modules, {transitions} transitions, "
          f"{returns} returns to a module already left")
    print("   ", " ".join(m.replace("ckptd.", "") for m in mods))


def main() -> None:
    threading.setprofile(_profile)  # threads started from now on (the I/O pool included)
    sys.setprofile(_profile)
    with tempfile.TemporaryDirectory() as root:
        state = {"model": {"w": torch.randn(256, 256)}, "step": 1}
        ck = ckptd.Checkpointer(root, keep_last=0, agent=False)  # the in-process path
        ck.save(state, step=0)  # warm: imports, arenas
        report("save", trace(lambda: ck.save_async(state, step=1).result()))
        dst = {"model": {"w": torch.zeros(256, 256)}, "step": 0}
        ck.load(dst)
        report("load", trace(lambda: ck.load(dst)))
        ck.close()


if __name__ == "__main__":
    main()
