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
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from ckptd.agent.server import main as serve

    directory = args.dir or wire.agent_dir()
    return serve(args.node or wire.node_id(), directory, args.idle_exit)


if __name__ == "__main__":
    sys.exit(main())
