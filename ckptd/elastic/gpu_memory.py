"""The per-GPU memory model of the elastic planner.

Memory model (per GPU, GiB = 2**30 bytes; ``P`` = number of parameters, ``W`` = world size)::

    parameters   P * param_bytes                  / (W if zero_stage == 3 else 1)
    gradients    P * grad_bytes                   / (W if zero_stage >= 2 else 1)
    optimizer    P * optim_bytes * optim_slots    / (W if zero_stage >= 1 else 1)
    activations  activation_constant * micro_batch * sequence_length
                 * hidden_size * num_hidden_layers * dtype_bytes

Defaults: bf16 weights (2), fp32 gradients (4), Adam's two fp32 moments (4 x 2), and 16 for the
activation constant. ``state_gib`` is the sum of the first three terms, ``total_gib`` adds the
activations.
"""

from __future__ import annotations

import dataclasses

from ckptd.elastic.specs import InvalidSpec, ModelSpec, TrainingSpec

GIB = 1 << 30

# Defaults of the memory model (bytes per parameter unless said otherwise).
PARAM_BYTES = 2  # bf16 weights
GRAD_BYTES = 4  # fp32 gradients
OPTIM_BYTES = 4  # fp32 optimizer state ...
OPTIM_SLOTS = 2  # ... two slots (Adam's first and second moments)
ACTIVATION_CONSTANT = 16  # activation bytes per (token x hidden x layer x dtype byte)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory of one setting, in GiB (2**30 bytes).

    ``state_gib`` = parameters + gradients + optimizer state; ``total_gib`` = state + activations.

    Attributes:
        parameters_gib: the parameters this rank holds.
        gradients_gib: the gradients this rank holds.
        optimizer_gib: the optimizer state this rank holds.
        activations_gib: the activations of one micro-batch.

    Example:
        from ckptd import elastic

        m = elastic.MemoryEstimate(parameters_gib=1.0, gradients_gib=2.0, optimizer_gib=4.0,
                                   activations_gib=0.5)
        assert (m.state_gib, m.total_gib) == (7.0, 7.5)
    """

    parameters_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float

    @property
    def state_gib(self) -> float:
        """Parameters + gradients + optimizer state, in GiB."""
        return self.parameters_gib + self.gradients_gib + self.optimizer_gib

    @property
    def total_gib(self) -> float:
        """``state_gib`` + activations, in GiB."""
        return self.state_gib + self.activations_gib


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    optim_slots: float
    activation_constant: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidSpec(f"memory parameter {f.name} must be a number >= 0, got {value!r}")

    def state(self, model: ModelSpec, zero_stage: int, world_size: int) -> tuple[float, ...]:
        p = model.num_parameters
        params = p * self.param_bytes / (world_size if zero_stage >= 3 else 1)
        grads = p * self.grad_bytes / (world_size if zero_stage >= 2 else 1)
        optim = p * self.optim_bytes * self.optim_slots / (world_size if zero_stage >= 1 else 1)
        return params / GIB, grads / GIB, optim / GIB

    def activations(self, model: ModelSpec, micro_batch_size: int, sequence_length: int) -> float:
        elements = micro_batch_size * sequence_length * model.hidden_size * model.num_hidden_layers
        return self.activation_constant * elements * model.dtype_bytes / GIB

    def estimate(
        self, model: ModelSpec, zero_stage: int, world_size: int, micro: int, seq: int
    ) -> MemoryEstimate:
        params, grads, optim = self.state(model, zero_stage, world_size)
        return MemoryEstimate(params, grads, optim, self.activations(model, micro, seq))


def estimate_memory(
    model: ModelSpec,
    training: TrainingSpec,
    *,
    param_bytes: float = PARAM_BYTES,
    grad_bytes: float = GRAD_BYTES,
    optim_bytes: float = OPTIM_BYTES,
    optim_slots: float = OPTIM_SLOTS,
    activation_constant: float = ACTIVATION_CONSTANT,
) -> MemoryEstimate:
    """Per-GPU memory of ``training`` for ``model`` under the module's memory model: the
    state divided over the ranks as the ZeRO stage shards it, and the activations of one
    micro-batch.

    Args:
        model: the model's sizes.
        training: the batch and sharding settings.
        param_bytes: bytes per parameter (2: bf16).
        grad_bytes: bytes per gradient element (4: fp32).
        optim_bytes: bytes per optimizer state element (4: fp32).
        optim_slots: optimizer state elements per parameter (2: Adam's moments).
        activation_constant: activation bytes per token x hidden x layer x dtype byte.

    Returns:
        A :class:`MemoryEstimate`.

    Raises:
        InvalidSpec: a memory parameter that is not a number >= 0.

    Example:
        from ckptd import elastic

        m = elastic.ModelSpec(hidden_size=4096, num_hidden_layers=28,
                              num_parameters=4_832_071_680)
        t = elastic.TrainingSpec(1, 480, 6, 1, 4096)
        # 16 * 6 * 4096 * 4096 * 28 * 2 bytes of activations
        assert round(elastic.estimate_memory(m, t).activations_gib, 3) == 84.0
    """
    mm = MemoryModel(param_bytes, grad_bytes, optim_bytes, optim_slots, activation_constant)
    return mm.estimate(
        model,
        training.zero_stage,
        training.world_size,
        training.micro_batch_size,
        training.sequence_length,
    )
