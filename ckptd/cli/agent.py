"""``ckptd agent``: run this node's agent, or ask the running ones what they hold, or to stop.
``--status`` and ``--stop`` talk to the agents' sockets directly: they import no torch and
answer in well under a second."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from ckptd.agent.__main__ import add_arguments
from ckptd.cli.common import Add

STOP_WAIT_S = 5.0  # --stop waits this long for the agents to exit (they finish saves first)


def _running(node: str, directory: str) -> list[tuple[dict[str, str], int]]:
    from ckptd.agent import wire

    if not os.path.isdir(directory):
        return []
    return [(p, pid) for p in wire.node_agents(node, directory)
            if (pid := wire.lock_pid(p["lock"])) is not None]


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not reaped yet by its parent included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # it exited between the two looks
        return True
    except OSError:
        return False


def _size(n: Any) -> str:
    return "-" if n is None else f"{int(n) / 2**20:.1f} MiB"


def _describe(st: dict[str, Any]) -> str:
    lines = [f"agent pid {st['pid']} serves node {st['node']}: ckptd {st.get('version')} "
             f"(code {st.get('code')}), log {st.get('log')}",
             f"  memory: {_size(st.get('memory_used'))} held of a {_size(st.get('memory_budget'))}"
             f" budget; {st.get('sessions')} trainer(s) connected, {st.get('saves_running')} "
             "save(s) running"]
    for r in st.get("roots", []):
        when = ("in use" if r["in_use"] else
                f"given back in {r['released_in_s']:.0f} s unless a trainer comes")
        lines.append(f"  {r['url']}: {_size(r['bytes'])} in {r['steps']} step copies ({when})")
    if st.get("retiring"):
        lines.append(f"  retiring: {st['retiring']}")
    elif st.get("exits_in_s") is not None:
        lines.append(f"  idle for {st['idle_s']:.0f} s: exits in {st['exits_in_s']:.0f} s")
    return "\n".join(lines)


def cmd_agent(args: argparse.Namespace) -> int:
    from ckptd.agent import wire

    node = args.node or wire.node_id()
    if not (args.stop or args.status):
        from ckptd.agent.__main__ import run

        return run(args)
    directory = args.dir or wire.default_dir()
    if os.path.lexists(directory):
        wire.check_dir(directory)  # another user's, or a link: refused, not followed
    found = []
    for paths, pid in _running(node, directory):
        try:
            st = wire.request(paths["sock"], {"op": "status"}, timeout_s=5.0)
        except wire.Refused:
            raise
        except (OSError, ValueError) as e:
            st = {"pid": pid, "node": node, "error": f"does not answer ({e})"}
        st.setdefault("pid", pid)
        if args.stop:
            try:
                wire.request(paths["sock"], {"op": "stop"}, timeout_s=5.0)
            except (OSError, ValueError) as e:
                st["error"] = f"did not take the stop ({e})"
        found.append((paths, st))
    if args.stop:
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and not all(_gone(st["pid"]) for _, st in found):
            time.sleep(0.02)
        for _, st in found:
            st["stopped"] = _gone(st["pid"])
    if args.json:
        print(json.dumps({"node": node, "running": bool(found), "agents": [st for _, st in found]}))
    elif not found:
        print(f"no agent runs for node {node}")
    for _, st in found if not args.json else ():
        if args.stop:
            print(f"agent pid {st['pid']} of node {node}: " + (
                "stopped" if st.get("stopped") else
                f"stopping: it finishes its {st.get('saves_running', '?')} running save(s) and "
                f"serves its {st.get('sessions', '?')} trainer(s) for the grace window first"))
        else:
            print(_describe(st) if "error" not in st else
                  f"agent pid {st['pid']} of node {node} {st['error']}")
    return 0 if found or args.stop else 1


def register(add: Add) -> None:
    sp = add("agent", cmd_agent, "run this node's checkpoint agent (docs/agent.md)")
    add_arguments(sp)
    sp.add_argument("--stop", action="store_true",
                    help="ask this node's agents to stop (they finish their saves first)")
    sp.add_argument("--status", action="store_true",
                    help="what this node's agents hold and when they go (exit 1 if none runs)")
