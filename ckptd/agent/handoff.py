"""A save handed over by a stopping node's agent (``docs/agent.md``, *SIGTERM*): written here
as its own trainer's agent would have, and recorded beside its partial.

The record (``ranks/<attempt>/<rank>.handoff``, JSON: the step, the rank, the node that staged
it, the node that writes it, when it arrived; written before the files, so a commit is never
seen without it) is how the restarted run learns that its step was safe through a peer rather
than written inside the grace window (:func:`read_records`; the elastic history's
``safe_via``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckptd import config
from ckptd.agent import jobs
from ckptd.agent.gate import Gate
from ckptd.agent.session import background
from ckptd.manifest import layout
from ckptd.storage import Storage
from ckptd.writer import retention
from ckptd.writer.group_store import GroupStore
from ckptd.writer.job import run

log = logging.getLogger("ckptd.agent")


def write(storage: Storage, header: dict[str, Any], staged: torch.Tensor, node: str,
          give_up: Callable[[list[int]], str | None] | None = None,
          gate: Gate | None = None) -> None:
    """Write the handed-over job ``header["job"]`` whose staged bytes are ``staged``: its
    record, then the job (:func:`ckptd.writer.job.run`: files, partial, on rank 0 the commit;
    ``give_up``, ``gate``: as there), then the retention that commit owes (a handed-over save
    is its sender's last: nothing follows it here)."""
    job = jobs.decode(header["job"], staged)  # every slot checked against the bytes received
    share = job.share
    record = {"step": share.step, "rank": share.rank, "from": str(header["origin"]),
              "to": node, "arrived": time.time(), "nbytes": job.round.nbytes}
    try:
        storage.put_atomic(layout.handoff_path(share.step, share.attempt, share.rank),
                           json.dumps(record).encode())
    except OSError as e:  # the step can still be written; only the record of how is missing
        log.warning("ckptd agent: no hand-off record for rank %d step %d: %s", share.rank,
                    share.step, e)
    background()  # like this node's own saves: its training answers first
    with ThreadPoolExecutor(config.io_threads(), thread_name_prefix="ckptd-handoff-io",
                            initializer=background) as io:
        owed = retention.Owed()
        out = run(job, storage, io, staged, signals=GroupStore(None), owed=owed, give_up=give_up,
                  gate=gate)
    log.warning("ckptd agent: wrote node %s's rank %d step %d (%d bytes, handed over)%s",
                header["origin"], share.rank, share.step, out.nbytes,
                ", committed" if share.rank == 0 else "")
    owed.settle()


def read_records(storage: Storage, step: int, attempt: str) -> list[dict[str, Any]]:
    """The hand-off records of the attempt that committed ``step`` (its manifest's
    ``attempt``; an abandoned attempt's records say nothing about it); empty when every rank
    wrote its own share."""
    out = []
    d = layout.partials_dir(step, attempt)
    for name in storage.list_dir(d):
        if layout.is_handoff(name):
            try:
                doc = json.loads(storage.read_bytes(f"{d}/{name}"))
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict):
                out.append(doc)
    return out


__all__ = ["read_records", "write"]
