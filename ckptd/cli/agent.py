"""``ckptd agent``: run this node's agent, or ask the running one to stop."""

from __future__ import annotations

import argparse
import json

from ckptd.agent.__main__ import add_arguments
from ckptd.cli.common import Add


def cmd_agent(args: argparse.Namespace) -> int:
    from ckptd.agent import wire

    node = args.node or wire.node_id()
    if args.stop or args.status:
        from ckptd.agent.client import AgentClient

        try:
            client = AgentClient.connect({"url": "", "options": None}, threads=1, start=False,
                                         node=node, directory=args.dir)
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
    from ckptd.agent.__main__ import run

    return run(args)


def register(add: Add) -> None:
    sp = add("agent", cmd_agent, "run this node's checkpoint agent (docs/agent.md)")
    add_arguments(sp)
    sp.add_argument("--stop", action="store_true", help="ask the running agent to stop")
    sp.add_argument("--status", action="store_true", help="is an agent running (exit 1 if not)")
