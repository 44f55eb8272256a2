"""Batch settings of a resharded checkpoint: when the saved ``training`` metadata has a
``TrainingSpec`` under ``"spec"``, the offline reshard re-derives it for the new world with
:func:`ckptd.elastic.replan`, records the new spec and appends a ``history`` entry with reason
``"offline reshard"``. Without a spec the metadata is carried over unchanged.

``replan`` needs the model's sizes and the limits of the search. They come, in order, from the
command line, from the metadata (``"model"``: ``ModelSpec`` fields; ``"replan"``: ``tolerance``,
``mem_limit_gib``, ``max_micro_batch_size``, ``zero_stages``), and otherwise from defaults: the
model's sizes inferred from the checkpoint (parameters = elements of ``model/*``, hidden size =
the commonest length of 1-d ``model/*`` tensors, layers = the layer indices), the memory limit =
what the previous setting needed (``estimate_memory``), the largest micro-batch = the previous
one: the new setting then needs no more memory per GPU than the old one did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ckptd.manifest import Manifest

REASON = "offline reshard"


@dataclass
class Replanned:
    training: dict[str, Any]  # the new metadata
    table: str  # the plan's row of the elastic batch table (markdown)
    inferred_model: bool


def replan_training(training: dict[str, Any], manifest: Manifest, world: int, *,
                    zero: int | None = None, mem_limit_gib: float | None = None,
                    max_micro_batch_size: int | None = None, tolerance: float | None = None,
                    ) -> Replanned | None:
    """The re-derived metadata for ``world``, or None when there is no ``"spec"``."""
    if "spec" not in training:
        return None
    from ckptd import elastic
    from ckptd.elastic.specs import infer_model
    from ckptd.elastic.table import plan_table, render_markdown

    previous = elastic.TrainingSpec.from_json(training["spec"])
    inferred = "model" not in training
    model = (infer_model({n: t.shape for n, t in manifest.tensors.items()}) if inferred
             else elastic.ModelSpec(**training["model"]))
    saved = dict(training.get("replan", {}))
    kwargs: dict[str, Any] = {
        "tolerance": tolerance if tolerance is not None else saved.get("tolerance", 0.10),
        "mem_limit_gib": mem_limit_gib if mem_limit_gib is not None else saved.get(
            "mem_limit_gib", elastic.estimate_memory(model, previous).total_gib * (1 + 1e-9)),
        "max_micro_batch_size": max_micro_batch_size or saved.get(
            "max_micro_batch_size", previous.micro_batch_size),
        "zero_stages": (zero,) if zero is not None else tuple(
            saved.get("zero_stages", sorted({previous.zero_stage, 1, 2, 3}))),
    }
    plan = elastic.replan(model, previous, world, **kwargs)
    table = render_markdown(plan_table(model, previous, [world], **kwargs))
    history = list(training.get("history", []))
    history.append({
        "reason": REASON, "time": time.time(), "step": manifest.step,
        "previous_world_size": previous.world_size, "world_size": world,
        "previous_spec": previous.to_json(), "spec": plan.training.to_json(),
        "deviation": plan.deviation,
    })
    out = dict(training)
    out["spec"] = plan.training.to_json()
    out["history"] = history
    return Replanned(out, table, inferred)
