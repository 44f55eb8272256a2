"""``python -m ckptd.agent``: run this node's agent in the foreground (what ``ckptd agent``
and the automatic start run)."""

from __future__ import annotations

import argparse
import logging
import sys

from ckptd.agent import wire
from ckptd.config import parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The agent's options (also ``ckptd agent``'s)."""
    p.add_argument("--node", default=None, help="node id (default: $CKPTD_NODE_ID or host name)")
    p.add_argument("--dir", default=None, help="socket directory (default: $CKPTD_AGENT_DIR)")
    p.add_argument("--idle-exit", type=float, default=600.0,
                   help="exit after this many seconds with no client and no job (default 600)")
    p.add_argument("--keep-in-memory", type=int, default=1,
                   help="newest steps whose data each rank keeps in memory (default 1; 0: none)")
    p.add_argument("--memory-budget", type=parse_size, default=None,
                   help="bytes of host memory for arenas, kept steps and peer copies "
                        "(e.g. 64GiB; default: 90%% of /dev/shm's free space at start)")
    p.add_argument("--release-after", type=float, default=None,
                   help="give a root's kept steps back this many seconds after its last "
                        "trainer left (default: $CKPTD_AGENT_RELEASE_S, else 60)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    directory = args.dir or wire.agent_dir()
    node = args.node or wire.node_id()
    lock = wire.take_lock(wire.paths(node, directory)["lock"])
    if lock is None:  # decided before torch is imported: a racing second start exits at once
        logging.getLogger("ckptd.agent").info("ckptd agent: another agent serves node %s", node)
        return 0
    from ckptd.agent.server import main as serve
    from ckptd.agent.shm import shm_free

    budget = args.memory_budget if args.memory_budget is not None else int(0.9 * shm_free())
    return serve(node, directory, args.idle_exit, args.keep_in_memory, budget, lock,
                 args.release_after)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptd.agent", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
