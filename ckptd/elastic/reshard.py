"""``ckptd.reshard()``: a committed checkpoint rewritten for a planned new world, the library
function ``ckptd reshard`` calls (:func:`reshard`), and the batch settings of the result.

Batch settings of a checkpoint resharded offline: when the saved
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptd import config
from ckptd.elastic.history import NotElastic, TrainingMeta, resharded
from ckptd.elastic.search import replan
from ckptd.elastic.specs import infer_model
from ckptd.elastic.table import plan_table, render_markdown
from ckptd.manifest import Manifest

if TYPE_CHECKING:
    from ckptd.elastic.resharder import RankReport
    from ckptd.loader.layout_file import LayoutSpec


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


@dataclass
class Resharded:
    """What :func:`reshard` did (or, ``dry_run``, would do)."""

    source_url: str
    step: int
    world_size: int
    tp: int
    pp: int
    dp: int
    zero: int
    reports: list[RankReport]  # per target rank: pieces, bytes held, written, read
    replanned: Replanned | None  # the elastic run's new batch settings, if it is one
    dry_run: bool
    zero_from: str = ""  # where the ZeRO stage came from, when nobody gave it
    url: str | None = None  # the committed step (None: dry run)
    attempt: str | None = None
    nbytes: int = 0  # bytes written
    source_bytes_read: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class ReshardPlan:
    """A planned reshard (:func:`plan_reshard`): what it will read and write, per target rank;
    :meth:`dry_run` or :meth:`run`."""

    def __init__(self, resharder: Any, result: Resharded, manifest: Manifest,
                 storage_options: dict[str, Any] | None) -> None:
        self._resharder, self._result, self._manifest = resharder, result, manifest
        self._storage_options = storage_options  # the destination's, unless given
        self.total_bytes = sum(p.write_bytes for p in resharder.plans)  # to write

    def dry_run(self, on_bytes: Callable[[int], None] | None = None) -> Resharded:
        """Per target rank: bytes to read, ranges, peak memory; nothing written."""
        self._resharder.on_bytes = on_bytes
        self._result.reports = self._resharder.dry_run()
        return self._result

    def run(self, out: str, out_storage_options: dict[str, Any] | None = None,
            on_bytes: Callable[[int], None] | None = None) -> Resharded:
        """Write and commit under the new root ``out`` (which must not be a ckptd root
        already: taking one over would fail the job writing there). ``on_bytes``: called with
        each rank's bytes as they are written (a progress bar's update)."""
        from ckptd.storage import open_storage

        r, m = self._result, self._manifest
        self._resharder.on_bytes = on_bytes
        self._resharder.dest = open_storage(out, out_storage_options or self._storage_options)
        training = r.replanned.training if r.replanned is not None else dict(m.training)
        new, r.reports = self._resharder.run(training)
        r.dry_run = False
        r.url = f"{self._resharder.dest.url}/step-{new.step:09d}"
        r.attempt, r.nbytes = new.attempt, new.nbytes
        r.source_bytes_read = self._resharder.source_bytes_read
        return r


def plan_reshard(ckpt: str, world: int, *, tp: int | None = None, pp: int | None = None,
                 zero: int | None = None, layout: str | LayoutSpec | None = None,
                 storage_options: dict[str, Any] | None = None, threads: int | None = None,
                 budget: int | None = None, compression: str = "same",
                 mem_limit_gib: float | None = None, max_micro_batch_size: int | None = None,
                 tolerance: float | None = None) -> ReshardPlan:
    """Plan rewriting the committed checkpoint ``ckpt`` (a root: its newest step, or
    ``ROOT/step-NNNNNNNNN``) packed per rank of a world of ``world`` ranks. The target layout:
    a layout file (``layout``), else inferred from the checkpoint for ``tp``/``pp``/``zero``
    (``ckptd layout`` writes the same). An elastic run's batch settings are re-planned for
    ``world`` (``mem_limit_gib``, ``max_micro_batch_size``, ``tolerance`` override its policy)
    and the ZeRO stage follows them unless ``zero`` is given."""
    from ckptd.catalog import open_step
    from ckptd.elastic.resharder import Resharder
    from ckptd.loader.infer import infer_layout, is_fsdp2, propose_zero
    from ckptd.loader.layout_file import read_layout
    from ckptd.loader.targets import Resolver

    if world < 1:
        raise ValueError(f"the world size must be at least 1, got {world}")
    storage, step, manifest = open_step(ckpt, storage_options)
    replanned = replan_training(manifest.training, manifest, world, zero=zero,
                                mem_limit_gib=mem_limit_gib,
                                max_micro_batch_size=max_micro_batch_size, tolerance=tolerance)
    planned_zero = (int(replanned.training["spec"]["zero_stage"])
                    if replanned is not None else None)
    zero_from = "given" if zero is not None else "re-planned" if planned_zero is not None else ""
    if zero is None and planned_zero is None and layout is None:
        # an imported FSDP checkpoint is ZeRO 3 as saved; its layout says so
        proposed, why = propose_zero(manifest)
        planned_zero = proposed
        if proposed == 3 and tp in (None, 1) and is_fsdp2(manifest):
            planned_zero = 0  # FSDP2's own layout: stage 0's rules shard tensors along dim 0
            zero_from = (f"layout from the source: {why}; each target rank holds dim-0 shards, "
                         "as FSDP2 (ZeRO 3) does (--zero N: ZeRO flat buffers instead)")
        elif proposed is not None:
            zero_from = f"ZeRO {proposed} from the source layout: {why} (--zero chooses another)"
        else:
            zero_from = f"ZeRO 0: the source layout cannot tell: {why} (--zero chooses one)"
    if layout is not None:
        spec = read_layout(layout) if isinstance(layout, str) else layout
        spec = spec.with_parallel(tp, pp, zero)
    else:  # inferred for the stage it will run with (FSDP2's dim-0 rules only without ZeRO)
        stage = zero if zero is not None else planned_zero or 0
        spec = infer_layout(manifest, tp or 1, pp or 1, stage).with_parallel(
            tp, pp, zero if zero is not None else planned_zero)
    assignment = Resolver(spec, manifest, world).assignment()
    resharder = Resharder(
        storage, step, manifest, assignment,
        budget=budget or config.get().load_budget_bytes,
        threads=threads or config.io_threads(),
        replicate_small=config.get().replicate_small_bytes, compression=compression)
    plan = ReshardPlan(resharder, Resharded(storage.url, step, world, spec.tp, spec.pp,
                                            assignment.dp, spec.zero.stage, [], replanned,
                                            True, zero_from), manifest, storage_options)
    return plan


def reshard(ckpt: str, world: int, *, out: str | None = None, dry_run: bool = False,
            out_storage_options: dict[str, Any] | None = None, **options: Any) -> Resharded:
    """Rewrite the committed checkpoint ``ckpt`` for a world of ``world`` ranks and commit it
    under the new root ``out`` (:func:`plan_reshard` for the ``options``, then
    :meth:`ReshardPlan.run`); ``dry_run``: plan only (:meth:`ReshardPlan.dry_run`). The
    library side of ``ckptd reshard``.

    Args:
        ckpt: a root (its newest step) or ``ROOT/step-NNNNNNNNN``.
        world: the target world size (at least 1).
        out: the new root to commit into; one a job owns is refused.
        dry_run: plan only, write nothing.
        out_storage_options: storage options for ``out``.
        options: ``plan_reshard``'s: ``tp``, ``pp``, ``zero``, ``layout`` (a layout file or
            spec), ``storage_options``, ``threads``, ``budget``, ``compression``
            (``"same"`` by default), ``mem_limit_gib``, ``max_micro_batch_size``,
            ``tolerance``.

    Returns:
        A ``Resharded``: the step, the target world and layout, per-rank reports, the
        committed ``url`` (None for a dry run), bytes written and read.

    Raises:
        ValueError: neither ``out`` nor ``dry_run``, or ``world`` < 1.
        CheckpointNotFound: ``ckpt`` holds no committed step.

    Example:
        import os
        import tempfile
        import torch
        import ckptd

        root = tempfile.mkdtemp()
        with ckptd.Checkpointer(root) as ckpt:
            ckpt.save({"w": torch.arange(16.0).reshape(4, 4)}, step=1)
        out = os.path.join(tempfile.mkdtemp(), "four")
        done = ckptd.reshard(root, 4, out=out)
        assert done.world_size == 4 and done.step == 1
    """
    if not dry_run and not out:
        raise ValueError("reshard: give the new root (out) or ask for a dry run")
    plan = plan_reshard(ckpt, world, **options)
    if dry_run:
        return plan.dry_run()
    assert out is not None
    return plan.run(out, out_storage_options)


__all__ = ["Replanned", "ReshardPlan", "Resharded", "plan_reshard", "replan_training", "reshard"]
