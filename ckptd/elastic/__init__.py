"""Elastic training: batch re-derivation on a new world size, and preemption.

- :func:`replan` picks micro-batch, accumulation steps and ZeRO stage for a new world size
  (:mod:`ckptd.elastic.replan`); :func:`plan_table` does it for a range of world sizes
  (:mod:`ckptd.elastic.table`, what ``ckptd plan`` prints).
- :func:`on_preemption` / :func:`preempted` turn a SIGTERM on one rank into one agreed save
  point on every rank (:mod:`ckptd.elastic.preemption`).
- :func:`resume` starts an incarnation of an elastic run: re-planned settings, the checkpoint
  to load, the data position, the preemption save (:class:`ElasticRun`,
  :mod:`ckptd.elastic.resume`); :class:`TrainingMeta` is the training metadata every save of
  such a run carries, with its churn history (:mod:`ckptd.elastic.history`).
"""

from __future__ import annotations

from ckptd.elastic.commands import plot_history
from ckptd.elastic.history import (
    EXIT_RESTART,
    ElasticPolicy,
    HistoryEntry,
    NotElastic,
    PreemptionOutcome,
    TrainingMeta,
    WorldInfo,
    scale_up_wait_s,
    torchrun_world,
)
from ckptd.elastic.preemption import (
    PreemptionError,
    PreemptionWatch,
    grace_deadline,
    on_preemption,
    preempted,
    remaining_grace_s,
)
from ckptd.elastic.replan import (
    InvalidSpec,
    MemoryEstimate,
    ModelSpec,
    NoFeasiblePlan,
    Plan,
    TrainingSpec,
    batch_band,
    estimate_memory,
    planner,
    replan,
)
from ckptd.elastic.resume import ElasticRun, exit_now, resume
from ckptd.elastic.table import parse_world_range, plan_table, render_json, render_markdown

__all__ = [
    "EXIT_RESTART",
    "ElasticPolicy",
    "ElasticRun",
    "HistoryEntry",
    "InvalidSpec",
    "MemoryEstimate",
    "ModelSpec",
    "NoFeasiblePlan",
    "NotElastic",
    "Plan",
    "PreemptionError",
    "PreemptionOutcome",
    "PreemptionWatch",
    "TrainingMeta",
    "TrainingSpec",
    "WorldInfo",
    "batch_band",
    "estimate_memory",
    "exit_now",
    "grace_deadline",
    "on_preemption",
    "parse_world_range",
    "plan_table",
    "planner",
    "plot_history",
    "preempted",
    "remaining_grace_s",
    "render_json",
    "render_markdown",
    "replan",
    "resume",
    "scale_up_wait_s",
    "torchrun_world",
]
