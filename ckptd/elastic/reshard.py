"""Batch settings of a checkpoint resharded offline (``ckptd reshard``): when the saved
``training`` metadata is an elastic run's (:class:`ckptd.elastic.history.TrainingMeta`, its
only reader and writer), the run's reference settings are re-planned for the new world with
:func:`ckptd.elastic.replan` (as ``elastic.resume()`` would on that world) and recorded through
:func:`ckptd.elastic.history.resharded` (a history entry with reason ``"reshard"``). Other
metadata is carried over unchanged.

``replan`` needs the model's sizes and the limits of the search. They come, in order, from the
command line, from the metadata (its ``model`` and its ``policy``), and for the model otherwise
from the checkpoint: parameters = elements of ``model/*``, hidden size = the commonest length of
1-d ``model/*`` tensors, layers = the layer indices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ckptd.elastic.history import NotElastic, TrainingMeta, resharded
from ckptd.elastic.search import replan
from ckptd.elastic.specs import infer_model
from ckptd.elastic.table import plan_table, render_markdown
from ckptd.manifest import Manifest


@dataclass
class Replanned:
    training: dict[str, Any]  # the new metadata
    table: str  # the plan's row of the elastic batch table (markdown)
    inferred_model: bool


def replan_training(training: dict[str, Any], manifest: Manifest, world: int, *,
                    zero: int | None = None, mem_limit_gib: float | None = None,
                    max_micro_batch_size: int | None = None, tolerance: float | None = None,
                    ) -> Replanned | None:
    """The re-derived metadata for ``world``, or None when it is not an elastic run's."""
    try:
        meta = TrainingMeta.from_json(training, f"step {manifest.step}")
    except NotElastic:
        return None
    inferred = meta.model is None
    model = meta.model or infer_model({n: t.shape for n, t in manifest.tensors.items()})
    kwargs = meta.policy.replan_kwargs()
    for key, value in (("tolerance", tolerance), ("mem_limit_gib", mem_limit_gib),
                       ("max_micro_batch_size", max_micro_batch_size)):
        if value is not None:
            kwargs[key] = value
    if zero is not None:
        kwargs["zero_stages"] = (zero,)
    plan = replan(model, meta.reference, world, **kwargs)
    table = render_markdown(plan_table(model, meta.reference, [world], **kwargs))
    new = resharded(meta, plan.training, step=manifest.step, time=time.time())
    return Replanned(new.to_json(), table, inferred)
