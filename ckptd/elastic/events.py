"""The live event stream of an elastic run (JSON lines from every rank) and its summary: one
:class:`Incarnation` per (re)start, as the demo's table prints it.

Events are for watching a run and for the demo; the checkpoint's own record of the run is its
training metadata (:mod:`ckptd.elastic.history`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

log = logging.getLogger("ckptd.elastic")


class EventLog:
    """The live event stream of an elastic run: JSON lines (``{"ev", "rank", "t", ...}``) to
    the ``ckptd.elastic`` logger and, if given, appended to a local file (one ``write`` of an
    O_APPEND descriptor per line, so the ranks of a node may share it). Events: ``resume``,
    ``loaded``, ``training`` (first step of an incarnation), ``step`` (rank 0), ``save``,
    ``sigterm``, ``preempting``, ``preempt``, ``done``, and ``node_lost`` (written by whoever
    killed a node, e.g. the demo); :func:`summarize` reads them back."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path, self.rank = path, rank

    def emit(self, ev: str, *, quiet: bool = False, **fields: Any) -> None:
        """``quiet``: the file only (inside a signal handler, stay away from logging's locks)."""
        line = json.dumps({"ev": ev, "rank": self.rank, "t": time.time(), **fields})
        if not quiet:
            log.info("ckptd elastic %s", line)
        if self.path:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)


@dataclasses.dataclass(frozen=True)
class Incarnation:
    """One incarnation of the run, summarised from the workers' events."""

    world: int
    reason: str
    first_step: int
    last_step: int
    training: dict[str, Any]
    saves: int  # async saves (steps); their stalls are every rank's
    stall_median_s: float | None
    stall_max_s: float | None
    load_s: float | None
    ended_by: str  # "sigterm", "node lost" (SIGKILL, no warning) or "done"
    sigterm_to_committed_s: float | None  # the preemption save that ended it
    downtime_s: float | None  # first SIGTERM (or node loss) of its end -> the next one trains
    # the load's bytes over every rank: from the node agents' memory, their peer copies (of a
    # lost node's part), storage; None without a load
    bytes_from: tuple[int, int, int] | None = None
    # the wall-clock window its events fall in (every rank's, summarize's rule)
    window: tuple[float, float] = (0.0, float("inf"))
    # every step of the phase read exactly its positions of the global sample order (from the
    # trainers' sample logs); None when no log was kept
    exactly_once: bool | None = None


def summarize(events: list[dict[str, Any]]) -> list[Incarnation]:
    """Phases from the events of every incarnation (``resume`` events of rank 0 delimit them)."""
    starts = [e for e in events if e["ev"] == "resume" and e["rank"] == 0]
    phases = []
    for i, start in enumerate(starts):
        # an incarnation owns the events from 1 s before its rank 0 planned (other ranks may
        # log a moment earlier) to 1 s before the next one did (a restart takes seconds)
        t0 = start["t"] - 1.0
        t1 = starts[i + 1]["t"] - 1.0 if i + 1 < len(starts) else float("inf")
        mine = [e for e in events if t0 <= e["t"] < t1]
        steps = [e["step"] for e in mine if e["ev"] == "step"]
        saves = [e for e in mine if e["ev"] == "save"]
        stalls = sorted(e["stall_s"] for e in saves)  # every rank's
        loads = [e["load_s"] for e in mine if e["ev"] == "loaded"]
        loaded = [e for e in mine if e["ev"] == "loaded" and "from_memory" in e]
        sigterms = [e["t"] for e in mine if e["ev"] == "sigterm"]
        lost = [e["t"] for e in mine if e["ev"] == "node_lost"]
        committed = [e["signal_to_committed_s"] for e in mine if e["ev"] == "preempt"
                     and e["signal_to_committed_s"] is not None and e["signalled"]]
        nxt = [e["t"] for e in events if e["ev"] == "training" and e["t"] >= t1]
        phases.append(Incarnation(
            world=start["world"], reason=start["reason"], first_step=start["step"],
            last_step=max(steps, default=start["step"]), training=start["training"],
            saves=len({e["step"] for e in saves}),
            stall_median_s=stalls[len(stalls) // 2] if stalls else None,
            stall_max_s=stalls[-1] if stalls else None, load_s=max(loads, default=None),
            ended_by="node lost" if lost else "sigterm" if sigterms else "done",
            sigterm_to_committed_s=max(committed, default=None),
            downtime_s=min(nxt) - min(sigterms + lost) if (sigterms or lost) and nxt else None,
            bytes_from=(sum(e["from_memory"] for e in loaded), sum(e["from_peer"] for e in loaded),
                        sum(e["from_storage"] for e in loaded)) if loaded else None,
            window=(t0, t1)))
    return phases


def render_phases(phases: list[Incarnation]) -> str:
    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:.1f} ms"

    def s(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f} s"

    def once(x: bool | None) -> str:
        return "—" if x is None else "yes" if x else "**NO**"

    def kib(x: tuple[int, int, int] | None) -> str:
        return "—" if x is None else " / ".join(f"{n / 1024:.0f}" for n in x)

    head = ("| phase | world | steps | micro × accum | ZeRO | global batch | async saves | "
            "stall median / max | load | KiB from memory / peer / storage | ended by | "
            "SIGTERM → committed | downtime | exactly once |")
    lines = [head, "|" + "---:|" * 5 + "---:|---:|---|---:|---:|---|---:|---:|---|"]
    for i, p in enumerate(phases, 1):
        t = p.training
        # a node lost without warning takes the steps since the last commit with it: the next
        # incarnation starts earlier and trains them again
        redone = p.last_step - phases[i].first_step if i < len(phases) else 0
        ended = f"{p.ended_by} ({redone} steps redone)" if redone > 0 else p.ended_by
        # the steps it trained: it resumed from first_step (as the live log's "training on N
        # nodes from step first_step + 1" says)
        steps = f"{p.first_step + 1}–{p.last_step}" if p.last_step > p.first_step else "none"
        lines.append(
            f"| {i} ({p.reason}) | {p.world} | {steps} | "
            f"{t['micro_batch_size']} × {t['gradient_accumulation_steps']} | {t['zero_stage']} | "
            f"{p.world * t['micro_batch_size'] * t['gradient_accumulation_steps']} | {p.saves} | "
            f"{ms(p.stall_median_s)} / {ms(p.stall_max_s)} | {s(p.load_s)} | "
            f"{kib(p.bytes_from)} | {ended} | "
            f"{s(p.sigterm_to_committed_s)} | {s(p.downtime_s)} | {once(p.exactly_once)} |")
    return "\n".join(lines)
