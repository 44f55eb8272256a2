"""The restart flow of an elastic run under ``torchrun --nnodes=MIN:MAX``.

Every incarnation of the workers (first start, and each re-spawn after a preemption or a
membership change) calls :func:`ckptd.elastic.resume` (``incarnation.py``): it reads the new
world, finds the latest committed checkpoint, re-plans the batch settings from its
:class:`~ckptd.elastic.history.TrainingMeta` (aiming at the *reference* global batch, so
deviations never accumulate over restarts) and appends a history entry. The caller builds its
state for ``run.training`` and loads it with ``run.load`` (resharding). The data position is
the number of consumed samples: a step trains on samples ``[consumed, consumed +
global_batch)``, split by :meth:`ElasticRun.sample_indices`, so no sample is repeated or
skipped whatever the world size. ``integrations/torchrun/train.py`` is the complete loop;
``docs/elastic.md`` the guide.

A preemption saves the state as of the last completed optimizer step (a partial gradient
accumulation is recomputed after the restart). Exit codes: a worker that received SIGTERM
exits 0 (its node is going away); the others exit :data:`EXIT_RESTART` (75), because torchrun
ends the whole job as *succeeded* when every worker exits 0, while a failure makes the
surviving agents re-rendezvous and re-spawn.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ckptd import stateful
from ckptd.checkpointer import Checkpointer
from ckptd.data import GlobalBatchSampler, StreamOrder, check_spec, micro_batch_positions
from ckptd.data.order import Order
from ckptd.data.stream import Change, Stream, continue_stream
from ckptd.elastic import preemption
from ckptd.elastic.events import EventLog
from ckptd.elastic.history import (
    EXIT_RESTART,
    HistoryEntry,
    PreemptionOutcome,
    TrainingMeta,
    add_loss,
)
from ckptd.elastic.run_saves import RunSaves
from ckptd.elastic.search import InvalidSpec, TrainingSpec
from ckptd.loader.load import Strict
from ckptd.loader.reader import LoadResult
from ckptd.sharding import describe
from ckptd.world import dist_or_none, gather_object
from ckptd.writer.handle import SaveHandle, SaveResult

log = logging.getLogger("ckptd.elastic")


def _all_committed(committed: bool, projected_s: float,
                   hands_off: bool) -> tuple[bool, float, float]:
    """(every rank has the step committed, the slowest rank's projection, the slowest
    projection among the ranks whose node agent cannot hand a late save to a peer)."""
    dist = dist_or_none()
    out: list[Any] = [(committed, projected_s, hands_off)]
    if dist is not None and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, (committed, projected_s, hands_off))
    return (all(c for c, _, _ in out), max(p for _, p, _ in out),
            max((p for _, p, h in out if not h), default=-math.inf))


class ElasticRun:
    """One incarnation of an elastic run: its batch settings, data position and history.

    Made by :func:`ckptd.elastic.resume`. ``training`` is the plan for this world; ``step`` and
    ``consumed_samples`` advance with :meth:`step_done`; every save carries
    :meth:`metadata` as its ``training=`` dict.

    Args:
        ckpt: the run's Checkpointer.
        meta: the run's :class:`TrainingMeta` as resumed (or fresh).
        step: the step it starts at.
        resumed: whether it resumes a checkpoint (then :meth:`load` loads ``step``).
        dp_rank: this rank's data-parallel rank.
        events: the run's event log.
        on_sigterm: called on SIGTERM, after the event is logged.

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
        for _ in range(3):
            state["w"] += 1
            run.step_done(loss=2.0)
        run.save(state)
        assert ckpt.latest_step() == 3 and run.consumed_samples == 24
        run.close()
        ckpt.close()
    """

    def __init__(self, ckpt: Checkpointer, meta: TrainingMeta, *, step: int, resumed: bool,
                 dp_rank: int, events: EventLog,
                 on_sigterm: Callable[[], object] | None = None) -> None:
        self.ckpt = ckpt
        self.meta = meta
        self.step = step
        self.resumed_step = step if resumed else None
        self.dp_rank = dp_rank
        self._watch = preemption.PreemptionWatch()
        self._events = events
        self._on_sigterm_user = on_sigterm
        self._saves = RunSaves(step if resumed else None)
        self._first_step_pending = True

    # ------------------------------------------------------------------ what to train
    @property
    def training(self) -> TrainingSpec:
        """The batch settings of this incarnation (re-planned for its world)."""
        return self.meta.spec

    @property
    def consumed_samples(self) -> int:
        """The stream position: samples consumed by the optimizer steps so far."""
        return self.meta.consumed_samples

    @property
    def entry(self) -> HistoryEntry:
        """This incarnation's history entry."""
        return self.meta.history[-1]

    def sample_indices(self, micro_step: int, dp_rank: int | None = None) -> range:
        """The samples data-parallel rank ``dp_rank`` (default: ours) trains on in micro-step
        ``micro_step`` of the current optimizer step. Over every rank and micro-step they are
        exactly ``[consumed_samples, consumed_samples + global_batch_size)``.

        Args:
            micro_step: the micro-step within the optimizer step.
            dp_rank: a data-parallel rank; None: this rank's.

        Returns:
            A ``range`` of stream positions.

        Raises:
            InvalidSpec: a micro-step or rank outside the settings.

        Example:
            import tempfile
            import torch
            import ckptd
            from ckptd import elastic

            ckpt = ckptd.Checkpointer(tempfile.mkdtemp())
            reference = elastic.TrainingSpec(zero_stage=1, world_size=4, micro_batch_size=2,
                                             gradient_accumulation_steps=1, sequence_length=128)
            run = elastic.resume(ckpt, reference=reference, world_size=4)
            assert run.sample_indices(0, dp_rank=1) == range(2, 4)
            run.close()
            ckpt.close()
        """
        t = self.training
        r = self.dp_rank if dp_rank is None else dp_rank
        if not (0 <= micro_step < t.gradient_accumulation_steps and 0 <= r < t.world_size):
            raise InvalidSpec(f"micro-step {micro_step} / data-parallel rank {r} outside "
                              f"{t.gradient_accumulation_steps} x {t.world_size}")
        return micro_batch_positions(self.consumed_samples, micro_step, r, t.world_size,
                                     t.micro_batch_size)

    def batch_sampler(self, order: Order, *, steps: int | None = None,
                      allow_data_change: Change = False) -> GlobalBatchSampler:
        """A ``DataLoader`` ``batch_sampler`` of this rank's micro-batches from where the
        checkpoint stopped, in the global ``order`` (:class:`ckptd.data.GlobalOrder` or
        :class:`~ckptd.data.ShardedOrder`), for ``steps`` optimizer steps (None: no end).

        The order's fingerprint is saved with every checkpoint of this run; a resume whose order
        differs (dataset length, seed, shards, shuffling, block size) raises
        :class:`~ckptd.data.DataMismatch` naming what changed, unless ``allow_data_change``:
        ``True`` finishes the epoch in progress under the checkpoint's order and starts the
        new one at the next epoch; ``"now"`` starts a new epoch of the new order at once
        (``docs/data.md``). An order that differs only by its algorithm (a checkpoint of an
        older ckptd) finishes its epoch the same way, without the flag.

        Args:
            order: the data's global order.
            steps: optimizer steps to yield; None: without end.
            allow_data_change: False, True or ``"now"``, as above.

        Returns:
            A :class:`~ckptd.data.GlobalBatchSampler`.

        Raises:
            DataMismatch: the order differs from the checkpoint's (without
                ``allow_data_change``).

        Example:
            import tempfile
            import torch
            import ckptd
            from ckptd import elastic

            ckpt = ckptd.Checkpointer(tempfile.mkdtemp())
            reference = elastic.TrainingSpec(zero_stage=1, world_size=4, micro_batch_size=2,
                                             gradient_accumulation_steps=1, sequence_length=128)
            run = elastic.resume(ckpt, reference=reference, world_size=4)
            from ckptd.data import GlobalOrder

            sampler = run.batch_sampler(GlobalOrder(100, seed=0), steps=2)
            assert len(sampler) == 2 and all(len(batch) == 2 for batch in sampler)
            run.close()
            ckpt.close()
        """
        stream = self._stream(order, allow_data_change)
        t = self.training
        return GlobalBatchSampler(stream.simple() or stream, consumed=self.consumed_samples,
                                  dp_rank=self.dp_rank, dp_size=t.world_size,
                                  micro_batch=t.micro_batch_size,
                                  grad_accum=t.gradient_accumulation_steps, steps=steps)

    def check_data(self, order: Order | StreamOrder, *,
                   allow_data_change: Change = False) -> None:
        """Compare ``order``'s fingerprint with the checkpoint's (raise
        :class:`~ckptd.data.DataMismatch` naming what changed, unless ``allow_data_change``) and
        save it with this run's checkpoints. :meth:`batch_sampler` calls it; call it directly
        for a :class:`~ckptd.data.StreamOrder`, whose readers cannot change.

        Args:
            order: the data's order.
            allow_data_change: False, True or ``"now"`` (see :meth:`batch_sampler`).

        Raises:
            DataMismatch: the order differs from the checkpoint's.
        """
        if isinstance(order, StreamOrder):
            check_spec(self.meta.data, order.spec(), allow_change=bool(allow_data_change))
            self.meta = dataclasses.replace(self.meta, data=order.spec())
        else:
            self._stream(order, allow_data_change)

    def _stream(self, order: Order, allow_data_change: Change) -> Stream:
        stream, record, note = continue_stream(self.meta.data, self.consumed_samples, order,
                                               allow_change=allow_data_change)
        if note is not None and self.ckpt.rank == 0:
            log.warning("%s", note)
        self.meta = dataclasses.replace(self.meta, data=record)
        return stream

    # ------------------------------------------------------------------ progress
    def load(self, state: Any, *, strict: Strict = True) -> LoadResult | None:
        """Fill ``state`` (built for :attr:`training`) from the checkpoint this run resumes;
        ``None`` on a fresh start (``strict`` as for :meth:`ckptd.Checkpointer.load`). Records
        in the history entry the load time and where the job's bytes came from (the node
        agents' memory, their peer copies, storage).

        Args:
            state: the destination state tree.
            strict: as for :meth:`ckptd.Checkpointer.load`.

        Returns:
            The :class:`~ckptd.LoadResult`, or None on a fresh start.

        Raises:
            StateMismatch: the state does not fit the checkpoint (nothing modified).
        """
        if self.resumed_step is None:
            return None
        t0 = time.perf_counter()
        result = self.ckpt.load(state, step=self.resumed_step, strict=strict)
        load_s = time.perf_counter() - t0
        mine = (result.nbytes_from_memory, result.nbytes_from_peer, result.nbytes_from_storage)
        memory, peer, storage = (sum(n) for n in zip(*gather_object(mine), strict=True))
        self._set_entry(load_s=load_s, bytes_from_memory=memory, bytes_from_peer=peer,
                        bytes_from_storage=storage)
        self._events.emit("loaded", step=result.step, load_s=load_s,
                          nbytes_read=result.nbytes_read, from_memory=mine[0],
                          from_peer=mine[1], from_storage=mine[2])
        return result

    def step_done(self, loss: float | None = None) -> None:
        """One optimizer step finished: advance the step and the consumed samples, record the
        loss (the same value on every rank, e.g. all-reduced).

        Args:
            loss: the step's loss, or None.
        """
        m = self.meta
        self.step += 1
        losses, stride = m.losses, m.loss_stride
        if loss is not None:
            losses, stride = add_loss(losses, stride, self.step, loss)
        self.meta = dataclasses.replace(
            m, consumed_samples=m.consumed_samples + m.spec.global_batch_size, losses=losses,
            loss_stride=stride)
        if self._first_step_pending:
            self._first_step_pending = False
            if m.preempted_at is not None:
                self._set_entry(downtime_s=time.time() - m.preempted_at)
            self._events.emit("training", step=self.step, world=m.spec.world_size,
                              downtime_s=self.entry.downtime_s)
        if self.ckpt.rank == 0:
            self._events.emit("step", step=self.step, loss=loss, world=m.spec.world_size,
                              global_batch=m.spec.global_batch_size,
                              consumed=self.meta.consumed_samples)

    def metadata(self, *, preempted_at: float | None = None) -> dict[str, Any]:
        """The ``training=`` dict for a save of the current step.

        Args:
            preempted_at: the SIGTERM's time, for a preemption save.

        Returns:
            :meth:`TrainingMeta.to_json` of the run now.
        """
        return dataclasses.replace(self.meta, preempted_at=preempted_at).to_json()

    # ------------------------------------------------------------------ saving
    def save_async(self, state: Any, *, overlap: bool = False) -> SaveHandle:
        """``save_async`` of the current step with this run's metadata.

        Args:
            state: the state tree.
            overlap: as for :meth:`ckptd.Checkpointer.save_async`.

        Returns:
            The :class:`~ckptd.SaveHandle`.
        """
        self._saves.observe()
        handle = self.ckpt.save_async(state, step=self.step, overlap=overlap,
                                      training=self.metadata())
        self._saves.issued(self.step, handle)
        self._events.emit("save", step=self.step, stall_s=handle.stall_s, overlap=overlap)
        return handle

    def save(self, state: Any) -> SaveResult:
        """Save the current step and wait until it is committed.

        Args:
            state: the state tree.

        Returns:
            The :class:`~ckptd.SaveResult`.
        """
        result = self.save_async(state).result()
        self._saves.observe()
        return result

    def finish(self, state: Any) -> int:
        """Save the final step unless already saved, and wait for every save.

        Args:
            state: the state tree.

        Returns:
            0, the exit code of a finished run.
        """
        if self._saves.issued_step != self.step:
            self.save(state)
        self.ckpt.wait()
        self._saves.observe()
        self._events.emit("done", step=self.step, consumed=self.consumed_samples)
        return 0

    def close(self) -> None:
        """Stop watching for SIGTERM (restore the previous handler); main thread."""
        preemption.uninstall()

    def save_on_preemption(self, state: Any) -> PreemptionOutcome:
        """The preemption path: call it on every rank once :func:`ckptd.preempted` is True.

        Waits (at most the grace left) for this run's in-flight saves; unless the current step
        is then committed, projects the save's duration (this rank's bytes over its last
        measured write bandwidth) and, if the slowest rank's projection fits in the grace left,
        saves it uncompressed (``urgent=True``: through the run's own staging buffers and I/O
        threads). Otherwise the previous checkpoint stays ``latest`` and the reason is logged.
        The ranks agree on the decision (one all-gather). Never raises for a failed save: the
        outcome says what happened.

        Args:
            state: the state tree.

        Returns:
            A :class:`PreemptionOutcome`.
        """
        t0 = time.monotonic()

        def sigterm_here() -> bool:
            """Whether this rank has its SIGTERM by now: torchrun signals a node's workers one
            after another, so it may arrive after the ranks agreed to save; the node is going
            away all the same."""
            return self._watch.signal_time is not None

        signalled = sigterm_here()
        self._events.emit("preempting", step=self.step, signalled=signalled,
                          since_signal_s=self._since_signal())

        def outcome(saved: bool, reason: str, *, save_s: float = 0.0,
                    projected_s: float | None = None, nbytes: int = 0,
                    safe_via: str | None = None) -> PreemptionOutcome:
            got = sigterm_here()
            out = PreemptionOutcome(
                step=self.step, saved=saved, reason=reason,
                exit_code=0 if got else EXIT_RESTART, signalled=got,
                drain_s=drain_s, save_s=save_s, projected_s=projected_s, grace_left_s=left,
                signal_to_committed_s=self._since_signal() if saved else None, nbytes=nbytes,
                safe_via=safe_via)
            self._events.emit("preempt", **dataclasses.asdict(out), grace_s=self._watch.grace_s)
            return out

        drained = self._saves.drain(preemption.remaining_grace_s())
        drain_s = time.monotonic() - t0
        committed = self._saves.committed_step == self.step
        nbytes = 0 if committed else sum(
            p.view.numel() * p.view.element_size()
            for p in describe(stateful.unfold(state).tree, self.ckpt.rank,
                              self.ckpt.world_size).pieces if p.is_writer)
        bandwidth = self._saves.bandwidth or self.meta.policy.assumed_write_bytes_per_s
        projection = nbytes / bandwidth if drained else math.inf
        all_committed, projected, blocking = _all_committed(committed, projection,
                                                            drained and self.ckpt.hands_off)
        left = preemption.remaining_grace_s()
        if all_committed:
            return outcome(True, "already committed")
        if left is not None and blocking > left:  # a rank can neither write it nor hand it off
            what = (f"projected {projected:.1f}s ({nbytes} bytes at {bandwidth / 1e6:.0f} MB/s)"
                    if math.isfinite(projected) else "an in-flight save still writing")
            reason = (f"skipped: {what} exceeds the {left:.1f}s of grace left; step "
                      f"{self._saves.committed_step} stays latest")
            log.warning("ckptd: preemption save of step %d %s", self.step, reason)
            return outcome(False, reason, projected_s=projected)
        t1 = time.monotonic()
        try:
            h = self.ckpt.save_async(state, step=self.step, urgent=True,
                                     training=self.metadata(preempted_at=self._signal_wall_time()))
            # this process may be killed once its share is safe: committed, or held by a
            # peer's agent that writes it (its own agent could not in the grace left)
            if sigterm_here() and left is not None and h.wait_safe(max(0.0, left)) and not h.done():
                via = f"peer {h.handed_to}"
                self._saves.issued_step = self.step
                log.warning("ckptd: preemption save of step %d handed to node %s's agent, "
                            "which commits it", self.step, h.handed_to)
                return outcome(False, f"handed to node {h.handed_to}'s agent, which commits "
                               "it after this process exits", save_s=time.monotonic() - t1,
                               projected_s=projected, safe_via=via)
            result = h.result()
        except Exception as e:  # noqa: BLE001 - reported in the outcome and the log
            log.error("ckptd: preemption save of step %d failed: %s", self.step, e)
            return outcome(False, f"failed: {e}", save_s=time.monotonic() - t1,
                           projected_s=projected)
        self._saves.committed_step = self._saves.issued_step = self.step
        return outcome(True, "committed", save_s=time.monotonic() - t1, projected_s=projected,
                       nbytes=result.nbytes,
                       safe_via=f"peer {result.handed_to}" if result.handed_to else "storage")

    # ------------------------------------------------------------------ internals
    def _on_sigterm(self) -> None:
        """Runs inside the SIGTERM handler: one line to the events file, the user's callback."""
        newest = self._saves.newest
        phase = newest.phase.value if newest is not None else None
        self._events.emit("sigterm", quiet=True, step=self.step, save_phase=phase)
        if self._on_sigterm_user is not None:
            self._on_sigterm_user()

    def _since_signal(self) -> float | None:
        deadline = preemption.grace_deadline()
        if deadline is None:
            return None
        return time.monotonic() - (deadline - self._watch.grace_s)

    def _signal_wall_time(self) -> float | None:
        since = self._since_signal()
        return None if since is None else time.time() - since

    def _set_entry(self, **changes: Any) -> None:
        history = self.meta.history[:-1] + (dataclasses.replace(self.entry, **changes),)
        self.meta = dataclasses.replace(self.meta, history=history)
