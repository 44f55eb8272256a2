"""The elastic training metadata that every checkpoint of an elastic run carries, and its plot.

An :class:`~ckptd.elastic.ElasticRun` passes :meth:`TrainingMeta.to_json` as ``training=`` to
every save; ``load(...).training`` (and ``ckptd inspect``) give it back. It is plain JSON with a
version, documented in ``docs/elastic.md``::

    {"version": 1,
     "spec":      TrainingSpec.to_json() of the incarnation that saved,
     "reference": TrainingSpec.to_json() the run was configured with (re-plans aim at its batch),
     "model":     {"hidden_size", "num_hidden_layers", "num_parameters", "dtype_bytes"} | null,
     "policy":    {"tolerance", "mem_limit_gib", "max_micro_batch_size", "zero_stages",
                   "scale_up_cooldown_s", "assumed_write_bytes_per_s"},
     "consumed_samples": samples of every completed optimizer step up to the saved step,
     "history":   [{"step", "time", "reason", "world_size", "micro_batch_size",
                    "gradient_accumulation_steps", "zero_stage", "global_batch_size",
                    "deviation", "consumed_samples", "load_s", "bytes_from_memory",
                    "bytes_from_peer", "bytes_from_storage", "downtime_s"}, ...],
     "losses":    [[step, loss], ...]   (one point every "loss_stride" steps, <= 2048 points),
     "loss_stride": 1,
     "preempted_at": unix time of the SIGTERM that ended the saving incarnation, or null}

A history entry is appended each time the run (re)starts: ``reason`` is ``"start"``,
``"scale-down"``, ``"scale-up"`` or ``"restart"`` (same world size), and by ``ckptd reshard``
(``"reshard"``: the settings re-planned for the world the checkpoint was rewritten for). Only
this module knows the layout, for readers and writers alike; nothing here touches storage.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ckptd.data.order import integer
from ckptd.data.stream import epoch_at
from ckptd.elastic.search import InvalidSpec, ModelSpec, TrainingSpec
from ckptd.errors import CkptdError

log = logging.getLogger("ckptd.elastic")

TRAINING_META_VERSION = 1
# The loss series keeps at most this many points: when full, every other point is dropped and
# the recording stride doubles, so a long run keeps an evenly spaced curve in a bounded manifest.
MAX_LOSS_POINTS = 2048
REASONS = ("start", "scale-down", "scale-up", "restart", "reshard")


class NotElastic(CkptdError, ValueError):
    """A checkpoint's training metadata is missing or is not an elastic run's record.

    Example:
        from ckptd import elastic

        try:
            elastic.TrainingMeta.from_json({"loss": 0.5}, where="step 3")
        except elastic.NotElastic as e:
            assert str(e).startswith("step 3: no elastic training metadata")
        else:
            raise AssertionError("no error")
    """


@dataclasses.dataclass(frozen=True)
class ElasticPolicy:
    """How an elastic run re-plans, and when it may restart.

    ``tolerance``, ``mem_limit_gib``, ``max_micro_batch_size`` and ``zero_stages`` go to
    :func:`~ckptd.elastic.replan`. ``scale_up_cooldown_s`` is the minimum time between a
    restart and a scale-up that a joining node may cause (see :func:`scale_up_wait_s`).
    ``assumed_write_bytes_per_s`` projects the preemption save's duration before any save of
    this incarnation measured the real bandwidth.

    Args:
        tolerance: how far the global batch may move from the reference's (relative).
        mem_limit_gib: the per-GPU memory limit a plan must fit.
        max_micro_batch_size: the largest micro-batch a plan may use.
        zero_stages: the ZeRO stages a plan may use, in order of preference.
        scale_up_cooldown_s: seconds between a restart and a scale-up.
        assumed_write_bytes_per_s: the write bandwidth assumed before one is measured.

    Example:
        from ckptd import elastic

        policy = elastic.ElasticPolicy(tolerance=0.05, mem_limit_gib=120)
        assert policy.replan_kwargs()["tolerance"] == 0.05
        assert elastic.ElasticPolicy.from_json(policy.to_json()) == policy
    """

    tolerance: float = 0.10  # the Fast-LLM analysis: ±10 % suffices with a few accum. steps
    mem_limit_gib: float = 80.0  # an 80 GB accelerator; set it below the real capacity
    max_micro_batch_size: int = 8
    zero_stages: tuple[int, ...] = (1, 2, 3)
    scale_up_cooldown_s: float = 300.0  # scale-ups cost at most D / (300 s + D) of the time
    assumed_write_bytes_per_s: float = 500e6  # a modest shared filesystem, per rank

    def replan_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~ckptd.elastic.replan` this policy sets."""
        return {"tolerance": self.tolerance, "mem_limit_gib": self.mem_limit_gib,
                "max_micro_batch_size": self.max_micro_batch_size,
                "zero_stages": self.zero_stages}

    def to_json(self) -> dict[str, Any]:
        """The policy as a JSON-able dict (:meth:`from_json` reads it back)."""
        record = dataclasses.asdict(self)
        record["zero_stages"] = list(self.zero_stages)
        return record

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> ElasticPolicy:
        """Decode :meth:`to_json`'s dict; unknown keys are ignored, missing ones default.

        Args:
            record: the dict.

        Returns:
            The ElasticPolicy.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in record.items() if k in names}
        if "zero_stages" in data:
            data["zero_stages"] = tuple(data["zero_stages"])
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class HistoryEntry:
    """One incarnation of the run: the settings it trained with from ``step`` on, and why."""

    step: int
    time: float  # unix time the incarnation was planned
    reason: str  # one of REASONS
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    zero_stage: int
    global_batch_size: int
    deviation: float  # global batch relative to the reference's
    consumed_samples: int
    load_s: float | None = None  # time the load took (None on a fresh start)
    # where the load's bytes came from, over every rank (docs/agent.md): the node agents' own
    # memory, the peer copies they hold of other nodes' parts, storage
    bytes_from_memory: int | None = None
    bytes_from_peer: int | None = None
    bytes_from_storage: int | None = None
    downtime_s: float | None = None  # previous incarnation's SIGTERM -> first step here
    # how the step resumed from was made safe when the previous incarnation was preempted:
    # "storage" (written inside the grace window), "peer <nodes>" (some ranks' shares were
    # handed to those nodes' agents, which wrote them; docs/agent.md); None: not a preemption
    safe_via: str | None = None

    @classmethod
    def of(cls, spec: TrainingSpec, *, step: int, time: float, reason: str,
           reference: TrainingSpec, consumed_samples: int) -> HistoryEntry:
        if reason not in REASONS:
            raise InvalidSpec(f"history reason must be one of {REASONS}, got {reason!r}")
        ref = reference.global_batch_size
        return cls(step=step, time=time, reason=reason, world_size=spec.world_size,
                   micro_batch_size=spec.micro_batch_size,
                   gradient_accumulation_steps=spec.gradient_accumulation_steps,
                   zero_stage=spec.zero_stage, global_batch_size=spec.global_batch_size,
                   deviation=(spec.global_batch_size - ref) / ref,
                   consumed_samples=consumed_samples)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> HistoryEntry:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: record[n] for n in names if n in record})


@dataclasses.dataclass(frozen=True)
class TrainingMeta:
    """The ``training`` dict of an elastic run's checkpoint (see the module docstring).

    Attributes:
        spec: the batch settings the checkpoint was trained with.
        reference: the configured settings every re-plan stays near.
        model: the model's sizes, when given.
        policy: the run's :class:`ElasticPolicy`.
        consumed_samples: the stream position: samples consumed so far.
        history: one entry per incarnation (settings, reason, load and downtime figures).
        losses: ``(step, loss)`` points, thinned to a bounded number.
        loss_stride: the steps between recorded losses.
        preempted_at: the SIGTERM's time, for a preemption save; else None.
        data: the data order's fingerprint, once the run has one.

    Example:
        import tempfile
        import torch
        import ckptd
        from ckptd import elastic

        ckpt = ckptd.Checkpointer(tempfile.mkdtemp())
        reference = elastic.TrainingSpec(zero_stage=1, world_size=4, micro_batch_size=2,
                                         gradient_accumulation_steps=1, sequence_length=128)
        run = elastic.resume(ckpt, reference=reference, world_size=4)
        run.step_done(loss=1.5)
        meta = elastic.TrainingMeta.from_json(run.metadata())
        assert meta.consumed_samples == 8 and meta.losses == ((1, 1.5),)
        run.close()
        ckpt.close()
    """

    spec: TrainingSpec
    reference: TrainingSpec
    model: ModelSpec | None
    policy: ElasticPolicy
    consumed_samples: int
    history: tuple[HistoryEntry, ...]
    losses: tuple[tuple[int, float], ...] = ()
    loss_stride: int = 1
    preempted_at: float | None = None
    # the data order's fingerprint (ckptd.data: kind, length, seed, ...), once the run has one
    data: dict[str, Any] | None = None

    def epoch(self, consumed_samples: int) -> int | None:
        """The data epoch at a stream position, when the run's data order is known.

        Args:
            consumed_samples: a stream position.

        Returns:
            The epoch, or None without a data order.
        """
        return epoch_at(self.data, consumed_samples)

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-able dict with a format version (``ElasticRun.metadata``)."""
        return {
            "version": TRAINING_META_VERSION,
            "spec": self.spec.to_json(),
            "reference": self.reference.to_json(),
            "model": None if self.model is None else dataclasses.asdict(self.model),
            "policy": self.policy.to_json(),
            "consumed_samples": self.consumed_samples,
            "history": [e.to_json() for e in self.history],
            "losses": [[s, v] for s, v in self.losses],
            "loss_stride": self.loss_stride,
            "preempted_at": self.preempted_at,
            "data": self.data,
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any] | str, where: str = "training") -> TrainingMeta:
        """Decode :meth:`to_json`'s dict (or its text).

        Args:
            record: the dict, or its JSON text.
            where: names the source in errors.

        Returns:
            The TrainingMeta.

        Raises:
            NotElastic: not an elastic run's record, of another version, or malformed.
        """
        data: Any = json.loads(record) if isinstance(record, str) else record
        if not isinstance(data, Mapping) or "spec" not in data:
            raise NotElastic(f"{where}: no elastic training metadata (was it saved by an "
                             "ElasticRun?)")
        if data.get("version") != TRAINING_META_VERSION:
            raise NotElastic(f"{where}: elastic metadata version {data.get('version')!r} is not "
                             f"supported (expected {TRAINING_META_VERSION})")
        try:
            spec = TrainingSpec.from_json(data["spec"])
            model = data.get("model")
            return cls(
                spec=spec,
                reference=TrainingSpec.from_json(data.get("reference") or data["spec"]),
                model=None if model is None else ModelSpec(**model),
                policy=ElasticPolicy.from_json(data.get("policy") or {}),
                consumed_samples=integer(data["consumed_samples"], "consumed_samples"),
                history=tuple(HistoryEntry.from_json(e) for e in data.get("history", [])),
                losses=tuple((int(s), float(v)) for s, v in data.get("losses", [])),
                loss_stride=int(data.get("loss_stride", 1)),
                preempted_at=data.get("preempted_at"),
                data=_data_spec(data.get("data")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise NotElastic(f"{where}: malformed elastic metadata: {e}") from e


def _data_spec(raw: Any) -> dict[str, Any] | None:
    if raw is not None and not isinstance(raw, Mapping):
        raise TypeError(f"'data' is not an object: {raw!r}")
    return None if raw is None else dict(raw)


def resharded(meta: TrainingMeta, spec: TrainingSpec, *, step: int, time: float) -> TrainingMeta:
    """``meta`` after ``ckptd reshard`` rewrote its checkpoint for ``spec.world_size`` ranks with
    the re-planned ``spec``: the next ``resume()`` on that world continues with it (a restart)."""
    entry = HistoryEntry.of(spec, step=step, time=time, reason="reshard",
                            reference=meta.reference, consumed_samples=meta.consumed_samples)
    return dataclasses.replace(meta, spec=spec, history=meta.history + (entry,))


def add_loss(losses: Sequence[tuple[int, float]], stride: int, step: int,
             loss: float) -> tuple[tuple[tuple[int, float], ...], int]:
    """``losses`` with ``(step, loss)`` recorded if ``step`` is on the stride; thinned (stride
    doubled) when it would exceed :data:`MAX_LOSS_POINTS`. Returns the points and the stride."""
    points = tuple(losses)
    if step % stride == 0 and math.isfinite(loss):
        points += ((step, float(loss)),)
    while len(points) > MAX_LOSS_POINTS:
        stride *= 2
        points = tuple(p for p in points if p[0] % stride == 0)
    return points, stride


def scale_up_wait_s(meta: TrainingMeta, now: float, cooldown_s: float | None = None) -> float:
    """Seconds a node that wants to join the run must still wait (the scale-up cooldown).

    A joining node makes the running workers stop and restart, so it waits until
    ``scale_up_cooldown_s`` (or ``cooldown_s``) have passed since the run's newest (re)start,
    the time of its last history entry. When the newest checkpoint is a preemption save
    (``preempted_at`` is set), the run is stopped or already restarting: joining now costs no
    extra restart, so the wait is 0.

    Args:
        meta: the newest checkpoint's :class:`TrainingMeta`.
        now: the current unix time.
        cooldown_s: the cooldown; None: the run's ``policy.scale_up_cooldown_s``.

    Returns:
        Seconds to wait, 0.0 or more.

    Example:
        import tempfile
        import torch
        import ckptd
        from ckptd import elastic

        ckpt = ckptd.Checkpointer(tempfile.mkdtemp())
        reference = elastic.TrainingSpec(zero_stage=1, world_size=4, micro_batch_size=2,
                                         gradient_accumulation_steps=1, sequence_length=128)
        run = elastic.resume(ckpt, reference=reference, world_size=4)
        meta = elastic.TrainingMeta.from_json(run.metadata())
        started = meta.history[-1].time
        assert elastic.scale_up_wait_s(meta, started + 60, cooldown_s=300) == 240
        assert elastic.scale_up_wait_s(meta, started + 400, cooldown_s=300) == 0
        run.close()
        ckpt.close()
    """
    cooldown = meta.policy.scale_up_cooldown_s if cooldown_s is None else cooldown_s
    if not meta.history or meta.preempted_at is not None:
        return 0.0
    return max(0.0, meta.history[-1].time + cooldown - now)


EXIT_RESTART = 75  # EX_TEMPFAIL: "a peer was preempted; re-spawn me"


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """What torchrun tells a worker about this incarnation (environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    nodes: int  # GROUP_WORLD_SIZE: agents (nodes) in this rendezvous round
    restart_count: int  # TORCHELASTIC_RESTART_COUNT
    run_id: str  # TORCHELASTIC_RUN_ID


def torchrun_world(env: dict[str, str] | None = None) -> WorldInfo:
    """The worker's place in the world from torchrun's environment (defaults: one process)."""
    e = os.environ if env is None else env
    return WorldInfo(int(e.get("RANK", 0)), int(e.get("WORLD_SIZE", 1)),
                     int(e.get("LOCAL_RANK", 0)), int(e.get("GROUP_WORLD_SIZE", 1)),
                     int(e.get("TORCHELASTIC_RESTART_COUNT", 0)),
                     e.get("TORCHELASTIC_RUN_ID", ""))


@dataclasses.dataclass(frozen=True)
class PreemptionOutcome:
    """What :meth:`ElasticRun.save_on_preemption` did; ``exit_code`` is what to exit with.

    Attributes:
        step: the step the run was at.
        saved: the state at ``step`` is committed (now or by an earlier save).
        reason: why it saved or did not, in words.
        exit_code: what the process should exit with (``EXIT_RESTART`` or 0).
        signalled: this rank received the SIGTERM itself.
        drain_s: seconds spent waiting for in-flight saves.
        save_s: seconds of the preemption save (0 when none was made).
        projected_s: the agreed projection of the save's duration.
        grace_left_s: the grace left when the decision was taken.
        signal_to_committed_s: SIGTERM to committed (None if nothing was committed).
        nbytes: bytes this rank wrote in the preemption save.
        safe_via: ``"storage"``, ``"peer <node>"`` (handed to that node's agent: ``saved``
            is False), or None when there was no save.

    Example:
        import ckptd
        from ckptd import elastic

        def on_preemption(run, state):  # call it on every rank once ckptd.preempted()
            outcome = run.save_on_preemption(state)
            print(outcome.reason, outcome.safe_via)
            elastic.exit_now(outcome.exit_code)
    """

    step: int
    saved: bool  # the state at ``step`` is committed (now or by an earlier save)
    reason: str
    exit_code: int
    signalled: bool  # this rank received the SIGTERM itself (before it returned)
    drain_s: float  # waiting for in-flight saves
    save_s: float  # the preemption save (0 when none was needed or it was skipped)
    projected_s: float | None  # the agreed projection of the save's duration
    grace_left_s: float | None  # grace left when the decision was taken
    signal_to_committed_s: float | None  # SIGTERM -> committed (None if nothing committed)
    nbytes: int  # bytes this rank wrote in the preemption save
    # how the preemption save was made safe: "storage" (committed inside the grace window) or
    # "peer <node>" (this node's agent could not write it in time and handed it to that node's
    # agent, which commits it after this process exits: ``saved`` is False); None: no save
    safe_via: str | None = None
