"""Whether a writing Checkpointer uses the node agent, and getting one for it (started if none
runs, drained of an earlier run's saves); :class:`~ckptd.agent.client.AgentClient` is the
connection itself. ``docs/agent.md``, *When it is on*."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ckptd import config
from ckptd.agent import wire
from ckptd.agent.client import AgentClient
from ckptd.errors import CkptdError

log = logging.getLogger("ckptd")

MIN_TIMEOUT_S = 2 * wire.HEARTBEAT_S  # the silence that means lost: two heartbeats missed


def timeout_s() -> float:
    """``$CKPTD_AGENT_TIMEOUT_S`` (default 5): the silence after which a trainer declares its
    agent lost (and kills it). Below a few heartbeats a busy agent would be killed under the
    other jobs it serves: refused."""
    value = config.AGENT_TIMEOUT_S.get()
    if not value >= MIN_TIMEOUT_S:  # (nan too)
        raw = os.environ.get(config.AGENT_TIMEOUT_S.name, "").strip()
        raise CkptdError(f"{config.AGENT_TIMEOUT_S.name}={raw!r}: at least {MIN_TIMEOUT_S:g} s "
                         f"(the agent's heartbeat comes every {wire.HEARTBEAT_S:g} s)")
    return value


def agent_wanted(wanted: bool | None, root: str, *, own_storage: bool) -> bool:
    """Whether a writing Checkpointer of ``root`` uses a node agent: ``wanted`` (None:
    ``$CKPTD_AGENT``, and when that is unset, yes for a job a launcher started, on Linux:
    :func:`_default_on`), and a root the agent can open itself (no storage object, no
    ``memory://``). The same on every rank of a job (loads decide a collective on it)."""
    if wanted is None:
        wanted = _default_on()
    return wanted and own_storage and not root.startswith("memory://")


# What a launcher sets in every process it starts: torchrun (and torchelastic), SLURM, and the
# env:// rendezvous convention that Kubernetes' PyTorchJob, SageMaker and MPI wrappers follow.
LAUNCHERS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE")


def _default_on() -> bool:
    """``$CKPTD_AGENT`` (1/true/yes/on, 0/false/no/off); unset: Linux (the agent checks its
    clients' credentials with ``SO_PEERCRED``) and a job started by a launcher — a long job
    whose trainers can die under it, where a save outliving its process pays for a process per
    node. A script or a notebook run by hand saves in process (``docs/agent.md``, *When it is
    on*)."""
    value = config.AGENT.get()
    if value is None:
        return sys.platform.startswith("linux") and any(os.environ.get(v) for v in LAUNCHERS)
    return value


def connect_for(wanted: bool | None, root: str, storage_options: dict[str, Any] | None, *,
                own_storage: bool, threads: int, incarnation: str,
                rank: int) -> AgentClient | None:
    """This node's agent for a writing Checkpointer of ``root`` (started if none runs), once an
    earlier incarnation's saves in it are done (``incarnation``: ``SaveOptions.incarnation``,
    the agent's name for a run); None without one: not ``wanted`` (:func:`agent_wanted`), a
    storage object or ``memory://`` root the agent could not open (not
    ``own_storage``), or none to be had (with a warning)."""
    if not agent_wanted(wanted, root, own_storage=own_storage):
        return None
    silence = timeout_s()  # a bad setting is the caller's error, not a reason to save in process
    drain_s = config.AGENT_DRAIN_S.get()
    try:
        client = AgentClient.connect({"url": root, "options": storage_options}, threads=threads,
                                     timeout_s=silence, trainer=(incarnation, rank))
    except (CkptdError, OSError) as e:
        log.warning("ckptd: rank %d: no node agent (%s); saving in process", rank, e)
        return None
    try:
        # a previous incarnation's last saves commit before this one claims the root
        busy = client.drain(incarnation, drain_s)
    except (CkptdError, OSError) as e:
        client.close()
        log.warning("ckptd: rank %d: the node agent did not drain (%s); saving in process",
                    rank, e)
        return None
    if busy:
        log.warning("ckptd: rank %d: the node agent still runs %d save(s) of an earlier job",
                    rank, busy)
    return client


__all__ = ["LAUNCHERS", "MIN_TIMEOUT_S", "agent_wanted", "connect_for", "timeout_s"]
