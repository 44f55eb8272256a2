"""A node's entry point for an elastic run: honour the scale-up cooldown, then become torchrun.

A node that joins a running job makes every worker stop, save and restart. To keep a flapping
node pool from restarting the job over and over, a node first reads the run's newest checkpoint
and waits until ``scale_up_cooldown_s`` (the policy stored in the checkpoint, or
``--cooldown-s``) has passed since the run's last (re)start; then it ``exec``s torchrun with
the arguments after ``--``. No checkpoint yet, or a newest checkpoint written by a preemption
save (the job is stopped or restarting), means no wait::

    python integrations/torchrun/join.py --ckpt /shared/ckpts/run1 -- \\
        torchrun --nnodes=1:64 --nproc-per-node=8 ... integrations/torchrun/train.py ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ckptd.cli.elastic import read_meta
from ckptd.elastic import scale_up_wait_s
from ckptd.errors import CheckpointNotFound


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: join.py --ckpt ROOT [--cooldown-s S] -- torchrun ...")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--cooldown-s", type=float, default=None)
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    try:
        _, meta = read_meta(args.ckpt)
        wait = scale_up_wait_s(meta, time.time(), args.cooldown_s)
    except CheckpointNotFound:
        wait = 0.0
    if wait > 0:
        print(f"join.py: the run restarted less than its cooldown ago; waiting {wait:.0f} s",
              file=sys.stderr, flush=True)
        time.sleep(wait)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
