"""Starting an incarnation of an elastic run: :func:`resume` (every rank, after
``torch.distributed``) reads the new world, finds the latest committed checkpoint, re-plans the
batch settings from its training metadata, appends a history entry and returns the
:class:`~ckptd.elastic.run.ElasticRun` that trains, saves and handles the preemption
(``ckptd/elastic/run.py`` describes the flow; ``docs/elastic.md`` is the guide).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ckptd import checkpointer
from ckptd.agent import handoff
from ckptd.checkpointer import Checkpointer
from ckptd.elastic import preemption
from ckptd.elastic.events import EventLog
from ckptd.elastic.history import ElasticPolicy, HistoryEntry, TrainingMeta, torchrun_world
from ckptd.elastic.run import ElasticRun
from ckptd.elastic.search import InvalidSpec, ModelSpec, TrainingSpec, replan
from ckptd.world import from_rank0

log = logging.getLogger("ckptd.elastic")


def resume(
    ckpt: Checkpointer | None = None,
    *,
    reference: TrainingSpec,
    model: ModelSpec | None = None,
    policy: ElasticPolicy | None = None,
    world_size: int | None = None,
    dp_rank: int | None = None,
    grace_s: float = 30.0,
    events: str | None = None,
    on_sigterm: Callable[[], object] | None = None,
) -> ElasticRun:
    """Start this incarnation of an elastic run (every rank, after ``torch.distributed``).

    ``reference`` is the configured setting: a fresh start uses it on its own world size and
    re-plans it on another; a restart re-plans from the reference stored in the checkpoint (so
    the global batch stays within ``policy.tolerance`` of it over any number of restarts), but
    keeps the previous settings when the world size did not change (bit-identical resume).
    ``model`` defaults to the checkpoint's; ``world_size`` / ``dp_rank`` are the data-parallel
    size and rank (default: the checkpointer's). Installs :func:`ckptd.on_preemption` with
    ``grace_s``; on SIGTERM a ``sigterm`` event is logged, then ``on_sigterm`` runs (keep it
    async-signal-light). ``events``: a local JSONL file for this run's events.

    Args:
        ckpt: the run's Checkpointer; None: the process default (``ckptd.init``).
        reference: the configured batch settings (required).
        model: the model's sizes; None: the checkpoint's.
        policy: the :class:`ElasticPolicy`; None: the defaults.
        world_size: the data-parallel size; None: the checkpointer's world size.
        dp_rank: this rank's data-parallel rank; None: the checkpointer's rank.
        grace_s: seconds between SIGTERM and SIGKILL.
        events: a local JSONL file for the run's events; None: none.
        on_sigterm: called on SIGTERM (inside the signal handler).

    Returns:
        The :class:`ElasticRun` of this incarnation (``run.close()`` uninstalls its handler).

    Raises:
        NoFeasiblePlan: no settings fit the new world size.
        NotElastic: the newest checkpoint was not saved by an elastic run.
        CkptdError: no ``ckpt`` and no ``ckptd.init`` before.

    Example:
        import tempfile
        import torch
        import ckptd
        from ckptd import elastic

        ckpt = ckptd.Checkpointer(tempfile.mkdtemp())
        reference = elastic.TrainingSpec(zero_stage=1, world_size=4, micro_batch_size=2,
                                         gradient_accumulation_steps=1, sequence_length=128)
        run = elastic.resume(ckpt, reference=reference, world_size=4)
        state = {"w": torch.zeros(2)}
        run.step_done()
        run.save(state)
        run.close()
        again = elastic.resume(ckpt, reference=reference, world_size=4)
        assert again.load(state).step == 1 and again.entry.reason == "restart"
        again.close()
        run.close()
        ckpt.close()
    """
    if ckpt is None:
        ckpt = checkpointer.default()
    policy = policy or ElasticPolicy()
    world = ckpt.world_size if world_size is None else world_size
    rank = ckpt.rank if dp_rank is None else dp_rank
    emitter = EventLog(events, ckpt.rank)

    def latest() -> tuple[float, int | None, dict[str, Any], list[str]]:
        step = ckpt.latest_step()
        if step is None:
            return time.time(), None, {}, []
        m = ckpt.read_manifest(step)
        # the nodes whose agents wrote shares of it that another node's agent handed over
        writers = sorted({str(r.get("to"))
                          for r in handoff.read_records(ckpt.storage, step, m.attempt)})
        return time.time(), step, dict(m.training), writers

    # rank 0 looks, everyone gets the same answer (and the same clock for the history entry);
    # the root is opened first on every rank, for opening is a collective
    ckpt.open()
    now, step, training, writers = from_rank0(latest)
    if step is None:
        spec = reference if world == reference.world_size else _replan(
            model, reference, world, policy)
        entry = HistoryEntry.of(spec, step=0, time=now, reason="start", reference=reference,
                                consumed_samples=0)
        meta = TrainingMeta(spec=spec, reference=reference, model=model, policy=policy,
                            consumed_samples=0, history=(entry,))
        resumed, step = False, 0
    else:
        prev = TrainingMeta.from_json(training, f"{ckpt.url} step {step}")
        if reference != prev.reference:
            log.warning("ckptd: the checkpoint's reference settings %s differ from the given "
                        "%s; keeping the checkpoint's", prev.reference, reference)
        model = model or prev.model
        if world == prev.spec.world_size:
            spec = prev.spec
        elif world == prev.reference.world_size:
            spec = prev.reference
        else:
            spec = _replan(model, prev.reference, world, policy)
        reason = ("restart" if world == prev.spec.world_size
                  else "scale-up" if world > prev.spec.world_size else "scale-down")
        entry = HistoryEntry.of(spec, step=step, time=now, reason=reason,
                                reference=prev.reference, consumed_samples=prev.consumed_samples)
        if writers or prev.preempted_at is not None:
            entry = dataclasses.replace(entry, safe_via=f"peer {', '.join(writers)}" if writers
                                        else "storage")
        meta = dataclasses.replace(prev, spec=spec, model=model, policy=policy,
                                   history=prev.history + (entry,))
        resumed = True
    run = ElasticRun(ckpt, meta, step=step, resumed=resumed, dp_rank=rank, events=emitter,
                     on_sigterm=on_sigterm)
    preemption.on_preemption(run._on_sigterm, grace_s=grace_s)
    env = torchrun_world()
    emitter.emit("resume", step=step, reason=entry.reason, world=world,
                 training=spec.to_json(), consumed=meta.consumed_samples,
                 deviation=entry.deviation, preempted_at=meta.preempted_at, nodes=env.nodes,
                 restart_count=env.restart_count, pid=os.getpid())
    log.info("ckptd: %s at step %d on %d data-parallel ranks: micro-batch %d x accumulation %d"
             " = global batch %d (%+.2f%%), ZeRO-%d", entry.reason, step, world,
             spec.micro_batch_size, spec.gradient_accumulation_steps, spec.global_batch_size,
             entry.deviation * 100, spec.zero_stage)
    return run


def _replan(model: ModelSpec | None, reference: TrainingSpec, world: int,
            policy: ElasticPolicy) -> TrainingSpec:
    if model is None:
        raise InvalidSpec(f"re-planning for world size {world} needs a ModelSpec (pass model=)")
    return replan(model, reference, world, **policy.replan_kwargs()).training


def exit_now(code: int, ckpt: Checkpointer | None = None) -> None:
    """``os._exit(code)`` after closing ``ckpt`` (default: the process default; waits for
    in-flight saves, raises a background error). A restart waits for every worker to exit, and
    tearing down an interpreter that imported torch took 3 s on the demo's loaded 2 cores.

    Args:
        code: the exit code (``EXIT_RESTART``: have the launcher restart the worker).
        ckpt: the Checkpointer to close first; None: the process default, if any.

    Raises:
        CkptdError: closing ``ckpt`` raised a background error (nothing exits then).

    Example:
        import subprocess
        import sys

        code = "from ckptd import elastic; elastic.exit_now(elastic.EXIT_RESTART)"
        assert subprocess.run([sys.executable, "-c", code]).returncode == 75
    """
    import sys

    if ckpt is None:
        ckpt = checkpointer.default_or_none()
    if ckpt is not None:
        ckpt.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
