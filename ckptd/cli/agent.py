"""``ckptd agent``: run this node's agent, or ask the running one to stop."""

from __future__ import annotations

import argparse
import json

from ckptd.cli.common import Add


def cmd_agent(args: argparse.Namespace) -> int:
    from ckptd.agent import wire

    directory = args.dir or wire.agent_dir()
    node = args.node or wire.node_id()
    if args.stop or args.status:
        from ckptd.agent.client import AgentClient

        try:
            client = AgentClient.connect({"url": "", "options": None}, threads=1, start=False,
                                         node=node)
        except wire.Refused:
            raise
        except Exception as e:  # noqa: BLE001 - "none runs" is the answer here
            print(json.dumps({"node": node, "running": False}) if args.json
                  else f"no agent runs for node {node} ({e})")
            return 1 if args.status else 0
        if args.stop:
            client.stop_agent()
        out = {"node": node, "running": True, "pid": client.pid, "stopping": args.stop}
        client.close()
        print(json.dumps(out) if args.json else
              f"agent pid {client.pid} serves node {node}" + (": stopping" if args.stop else ""))
        return 0
    from ckptd.agent.__main__ import main

    argv = ["--node", node, "--dir", directory, "--idle-exit", str(args.idle_exit),
            "--keep-in-memory", str(args.keep_in_memory)]
    return main(argv + (["--memory-budget", args.memory_budget] if args.memory_budget else []))


def register(add: Add) -> None:
    sp = add("agent", cmd_agent, "run this node's checkpoint agent (docs/agent.md)")
    sp.add_argument("--node", default=None, help="node id (default: $CKPTD_NODE_ID or host name)")
    sp.add_argument("--dir", default=None, help="socket directory (default: $CKPTD_AGENT_DIR)")
    sp.add_argument("--idle-exit", type=float, default=600.0,
                    help="exit after this many seconds with no client and no job")
    sp.add_argument("--keep-in-memory", type=int, default=1,
                    help="newest steps whose data each rank keeps in memory (default 1)")
    sp.add_argument("--memory-budget", default=None,
                    help="host memory for arenas, kept steps and peer copies, e.g. 64GiB "
                         "(default: 90%% of /dev/shm's free space)")
    sp.add_argument("--stop", action="store_true", help="ask the running agent to stop")
    sp.add_argument("--status", action="store_true", help="is an agent running (exit 1 if not)")
