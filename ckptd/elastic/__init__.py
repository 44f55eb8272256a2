"""Elastic training: batch re-derivation on a new world size, and preemption.

- :func:`replan` picks micro-batch, accumulation steps and ZeRO stage for a new world size
  (:mod:`ckptd.elastic.search`); :func:`plan_table` does it for a range of world sizes
  (:mod:`ckptd.elastic.table`, what ``ckptd plan`` prints).
- :func:`on_preemption` / :func:`preempted` turn a SIGTERM on one rank into one agreed save
  point on every rank (:mod:`ckptd.elastic.preemption`).
- :func:`resume` starts an incarnation of an elastic run: re-planned settings, the checkpoint
  to load, the data position (:mod:`ckptd.elastic.incarnation`); it returns the
  :class:`ElasticRun` that trains, saves and handles the preemption (:mod:`ckptd.elastic.run`).
  :class:`TrainingMeta` is the training metadata every save of such a run carries, with its
  churn history (:mod:`ckptd.elastic.history`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The public names (API.md's, and those docs/elastic.md and docs/api.md document), imported on
# first use: `ckptd plan` and `ckptd history` need only the torch-free planning modules.
_EXPORTS = {
    "EXIT_RESTART": "ckptd.elastic.history",
    "ElasticPolicy": "ckptd.elastic.history",
    "NotElastic": "ckptd.elastic.history",
    "PreemptionOutcome": "ckptd.elastic.history",
    "TrainingMeta": "ckptd.elastic.history",
    "scale_up_wait_s": "ckptd.elastic.history",
    "InvalidSpec": "ckptd.elastic.specs",
    "ModelSpec": "ckptd.elastic.specs",
    "TrainingSpec": "ckptd.elastic.specs",
    "MemoryEstimate": "ckptd.elastic.gpu_memory",
    "estimate_memory": "ckptd.elastic.gpu_memory",
    "NoFeasiblePlan": "ckptd.elastic.infeasible",
    "Plan": "ckptd.elastic.search",
    "replan": "ckptd.elastic.search",
    "parse_world_range": "ckptd.elastic.table",
    "plan_table": "ckptd.elastic.table",
    "render_json": "ckptd.elastic.table",
    "render_markdown": "ckptd.elastic.table",
    "ElasticRun": "ckptd.elastic.run",
    "exit_now": "ckptd.elastic.incarnation",
    "resume": "ckptd.elastic.incarnation",
}

__all__ = [
    "EXIT_RESTART",
    "ElasticPolicy",
    "ElasticRun",
    "InvalidSpec",
    "MemoryEstimate",
    "ModelSpec",
    "NoFeasiblePlan",
    "NotElastic",
    "Plan",
    "PreemptionOutcome",
    "TrainingMeta",
    "TrainingSpec",
    "estimate_memory",
    "exit_now",
    "parse_world_range",
    "plan_table",
    "render_json",
    "render_markdown",
    "replan",
    "resume",
    "scale_up_wait_s",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd.elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ckptd.elastic.gpu_memory import MemoryEstimate, estimate_memory
    from ckptd.elastic.history import (
        EXIT_RESTART,
        ElasticPolicy,
        NotElastic,
        PreemptionOutcome,
        TrainingMeta,
        scale_up_wait_s,
    )
    from ckptd.elastic.incarnation import exit_now, resume
    from ckptd.elastic.run import ElasticRun
    from ckptd.elastic.search import NoFeasiblePlan, Plan, replan
    from ckptd.elastic.specs import InvalidSpec, ModelSpec, TrainingSpec
    from ckptd.elastic.table import parse_world_range, plan_table, render_json, render_markdown
