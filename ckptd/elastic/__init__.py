"""Elastic training: batch re-derivation on a new world size, and preemption.

- :func:`replan` picks micro-batch, accumulation steps and ZeRO stage for a new world size
  (:mod:`ckptd.elastic.replan`); :func:`plan_table` does it for a range of world sizes
  (:mod:`ckptd.elastic.table`, what ``ckptd plan`` prints).
- :func:`on_preemption` / :func:`preempted` turn a SIGTERM on one rank into one agreed save
  point on every rank (:mod:`ckptd.elastic.preemption`).
"""

from __future__ import annotations

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
from ckptd.elastic.table import parse_world_range, plan_table, render_json, render_markdown

__all__ = [
    "InvalidSpec",
    "MemoryEstimate",
    "ModelSpec",
    "NoFeasiblePlan",
    "Plan",
    "PreemptionError",
    "PreemptionWatch",
    "TrainingSpec",
    "batch_band",
    "estimate_memory",
    "grace_deadline",
    "on_preemption",
    "parse_world_range",
    "plan_table",
    "planner",
    "preempted",
    "remaining_grace_s",
    "render_json",
    "render_markdown",
    "replan",
]
