"""The settings the elastic planner reads and writes: the model's sizes (:class:`ModelSpec`) and
one run's batch and sharding settings (:class:`TrainingSpec`, stored in checkpoint metadata as
versioned JSON). Pure data with validation; no I/O, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ckptd.errors import CkptdError

TRAINING_SPEC_VERSION = 1


class InvalidSpec(CkptdError, ValueError):
    """An argument of the elastic planner is out of range (a size < 1, an unknown ZeRO stage).

    Example:
        from ckptd import elastic

        try:
            elastic.TrainingSpec(zero_stage=4, world_size=8, micro_batch_size=1,
                                 gradient_accumulation_steps=1, sequence_length=128)
        except elastic.InvalidSpec as e:
            assert "ZeRO stage" in str(e)
        else:
            raise AssertionError("no error")
    """


def positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSpec(f"{owner}.{name} must be a positive int, got {value!r}")


def check_zero_stage(owner: str, value: object) -> None:
    if isinstance(value, bool) or value not in (0, 1, 2, 3):
        raise InvalidSpec(f"{owner}: ZeRO stage must be 0, 1, 2 or 3, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The sizes of a model that the memory model needs.

    Args:
        hidden_size: the hidden dimension.
        num_hidden_layers: the number of transformer layers.
        num_parameters: the number of parameters.
        dtype_bytes: bytes per activation element (2: bf16).

    Raises:
        InvalidSpec: a size that is not a positive int.

    Example:
        from ckptd import elastic

        model = elastic.ModelSpec(hidden_size=4096, num_hidden_layers=28,
                                  num_parameters=4_832_071_680)
        assert model.dtype_bytes == 2
    """

    hidden_size: int
    num_hidden_layers: int
    num_parameters: int
    dtype_bytes: int = 2  # bytes per activation element (bf16)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            positive_int("ModelSpec", f.name, getattr(self, f.name))


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    """Batch and sharding settings of one run; stored in checkpoint metadata.

    Args:
        zero_stage: the ZeRO stage, 0 to 3.
        world_size: the number of data-parallel ranks.
        micro_batch_size: samples per micro-batch and rank.
        gradient_accumulation_steps: micro-batches per optimizer step.
        sequence_length: tokens per sample.

    Raises:
        InvalidSpec: a size that is not a positive int, or an unknown ZeRO stage.

    Example:
        from ckptd import elastic

        t = elastic.TrainingSpec(zero_stage=1, world_size=480, micro_batch_size=6,
                                 gradient_accumulation_steps=1, sequence_length=4096)
        assert t.global_batch_size == 2880
        assert elastic.TrainingSpec.from_json(t.to_json()) == t
    """

    zero_stage: int
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    sequence_length: int

    def __post_init__(self) -> None:
        check_zero_stage("TrainingSpec", self.zero_stage)
        for f in dataclasses.fields(self):
            if f.name != "zero_stage":
                positive_int("TrainingSpec", f.name, getattr(self, f.name))

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step: world size x micro-batch x accumulation steps."""
        return self.world_size * self.micro_batch_size * self.gradient_accumulation_steps

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict with a format version (``json.dumps`` it to get text)."""
        record: dict[str, Any] = {"version": TRAINING_SPEC_VERSION}
        record.update(dataclasses.asdict(self))
        return record

    @classmethod
    def from_json(cls, record: Mapping[str, Any] | str) -> TrainingSpec:
        """Decode what :meth:`to_json` produced (the dict, or its ``json.dumps`` text).

        Args:
            record: the dict, or its JSON text.

        Returns:
            The TrainingSpec.

        Raises:
            InvalidSpec: not a record of this version, or a field missing or out of range.
        """
        data: Any = json.loads(record) if isinstance(record, str) else record
        if not isinstance(data, Mapping):
            raise InvalidSpec(f"TrainingSpec record must be a JSON object, got {data!r}")
        version = data.get("version")
        if version != TRAINING_SPEC_VERSION:
            raise InvalidSpec(
                f"TrainingSpec record version {version!r} is not supported "
                f"(expected {TRAINING_SPEC_VERSION})"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise InvalidSpec(f"TrainingSpec record lacks {', '.join(missing)}: {dict(data)!r}")
        return cls(**{n: data[n] for n in names})


def infer_model(shapes: dict[str, tuple[int, ...]], layer: str = r"layers\.(\d+)\.") -> ModelSpec:
    """A ModelSpec guessed from a checkpoint's logical tensors (name -> global shape), for
    checkpoints that carry no elastic metadata: parameters = elements of ``model/*`` (of every
    tensor if there is no ``model/``), hidden size = the commonest length of 1-d tensors (else the
    commonest last dimension of 2-d ones), layers = the distinct ``layers.N.`` indices."""
    names = [n for n in shapes if not n.startswith("__local__/")]
    params = [n for n in names if n.startswith("model/")] or names
    numel = sum(math.prod(shapes[n]) for n in params)
    ones = Counter(shapes[n][0] for n in params if len(shapes[n]) == 1)
    twos = Counter(shapes[n][-1] for n in params if len(shapes[n]) == 2)
    hidden = (ones or twos or Counter({1: 1})).most_common(1)[0][0]
    layers = {int(m.group(1)) for n in params if (m := re.search(layer, n))}
    return ModelSpec(max(1, hidden), max(1, len(layers)), max(1, numel))
