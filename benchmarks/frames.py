"""Manifest cost of the frame size: the figures behind ``ckptd.config``'s adaptive frames.

    python benchmarks/frames.py [--size 2GiB] [--ranks 4] [--dir DIR]

Saves the load benchmark's state (``common.build_state``: ``--ranks`` shares of a ``--size``
model + Adam state, dim 0 split over the ranks) once per frame setting, every rank's share from
one process (no collectives are needed to save), and prints per setting the chunks, the frame
entries and the size of the committed ``manifest.json``. Settings: ckptd's default (1 MiB,
halved down to 256 KiB for chunks of fewer than 64 frames), fixed 1 MiB, fixed 256 KiB. The
bytes a resharding load reads for each setting are ``benchmarks/load.py``'s
(``--frame-bytes``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import build_state, fmt_bytes, parse_size, scratch  # noqa: E402

import ckptd  # noqa: E402
from ckptd import config  # noqa: E402
from ckptd.manifest import layout as L  # noqa: E402

SETTINGS = {
    "default (adaptive)": {},
    "fixed 1 MiB": {"frame_bytes": 1 << 20, "min_frame_bytes": 1 << 20},
    "fixed 256 KiB": {"frame_bytes": 256 << 10, "min_frame_bytes": 256 << 10},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("2GiB"))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    states = [build_state(args.size, r, args.ranks).ckptd_tree() for r in range(args.ranks)]
    print(f"{fmt_bytes(args.size)} saved by {args.ranks} ranks\n")
    print("| frames | chunks | frame entries | manifest.json |\n|---|---:|---:|---:|")
    with scratch(args.dir) as base:
        for name, knobs in SETTINGS.items():
            root = tempfile.mkdtemp(prefix="ckptd-frames-", dir=base)
            try:
                with config.override(**knobs):
                    ckpts = [ckptd.Checkpointer(root, rank=r, world_size=args.ranks,
                                                run_id="frames") for r in range(args.ranks)]
                    for h in [c.save_async(s, step=1) for c, s in zip(ckpts, states, strict=True)]:
                        h.result()
                    manifest = ckpts[0].read_manifest(1)
                    for c in ckpts:
                        c.close()
                chunks = [ch for t in manifest.tensors.values() for ch in t.chunks]
                size = os.path.getsize(os.path.join(root, L.step_dir(1), L.MANIFEST))
                frames = sum(ch.n_frames for ch in chunks)
                print(f"| {name} | {len(chunks)} | {frames} | {size / 1e3:.0f} kB |")
            finally:
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
