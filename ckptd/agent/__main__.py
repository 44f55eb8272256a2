"""``python -m ckptd.agent``: run this node's agent in the foreground (what ``ckptd agent``
and the automatic start run)."""

from __future__ import annotations

import argparse
import logging
import sys

from ckptd.agent import wire


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptd.agent", description=__doc__)
    p.add_argument("--node", default=None, help="node id (default: $CKPTD_NODE_ID or host name)")
    p.add_argument("--dir", default=None, help="socket directory (default: $CKPTD_AGENT_DIR)")
    p.add_argument("--idle-exit", type=float, default=600.0,
                   help="exit after this many seconds with no client and no job (default 600)")
    p.add_argument("--keep-in-memory", type=int, default=1,
                   help="newest steps whose data each rank keeps in memory (default 1; 0: none)")
    p.add_argument("--memory-budget", default=None,
                   help="bytes of host memory for arenas, kept steps and peer copies "
                        "(e.g. 64GiB; default: 90%% of /dev/shm's free space at start)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    directory = args.dir or wire.agent_dir()
    node = args.node or wire.node_id()
    lock = wire.take_lock(wire.paths(node, directory)["lock"])
    if lock is None:  # decided before torch is imported: a racing second start exits at once
        logging.getLogger("ckptd.agent").info("ckptd agent: another agent serves node %s", node)
        return 0
    from ckptd.agent.server import main as serve

    return serve(node, directory, args.idle_exit, args.keep_in_memory,
                 _budget(args.memory_budget), lock)


def _budget(text: str | None) -> int:
    if text is None:
        from ckptd.agent.shm import shm_free

        return int(0.9 * shm_free())
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    num = t.rstrip("kmgt")
    return int(float(num) * units[t[len(num):]])


if __name__ == "__main__":
    sys.exit(main())
