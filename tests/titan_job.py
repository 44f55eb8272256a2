"""A small torchtitan training job on CPU gloo ranks, for tests/test_integration_torchtitan.py.

torchtitan's own components where the CPU allows: its ``OptimizersContainer`` (AdamW) and
``LRSchedulersContainer`` built from their configs, its ``ParallelAwareDataloader`` (a torchdata
``StatefulDataLoader``) over a stateful dataset, and a checkpoint manager built from its
``Config`` with the arguments torchtitan's ``Trainer`` passes. The model is an FSDP2
(``fully_shard``) stack of linears: torchtitan's model package imports ``triton`` at import
time, which the CPU build of torch does not have.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset


class Tokens(IterableDataset):  # type: ignore[type-arg]
    """Deterministic samples of one data-parallel rank, with a position torchdata saves."""

    def __init__(self, rank: int) -> None:
        self.rank, self.i = rank, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.i)
            self.i += 1
            yield torch.randn(8, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.i = sd["i"]


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def documented_config() -> Any:
    """The ``CkptdCheckpointManager.Config(...)`` of docs/integrations.md, evaluated."""
    from ckptd.integrations.torchtitan import CkptdCheckpointManager

    text = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    start = text.index("CkptdCheckpointManager.Config(")
    end = text.index("\n    )\n", start) + len("\n    )")
    return eval(text[start:end], {"CkptdCheckpointManager": CkptdCheckpointManager})


def build(rank: int, world: int, folder: str, manager: str, **checkpoint: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw


    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "foreach"
    optimizers = opt_config.build(model_parts=[model])
    lr = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, decay_type="linear",
                                      min_lr_factor=0.1).build(optimizers=optimizers,
                                                               training_steps=20)
    loader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world,
                                     batch_size=2)
    train_state = TrainState()
    test = {"interval": 2, "keep_latest_k": 0}
    if manager == "ckptd":  # the configuration docs/integrations.md shows, at a test's interval
        config = dataclasses.replace(documented_config(), **{**test, **checkpoint})
    else:
        config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=2,
                                          keep_latest_k=0, last_save_model_only=False,
                                          **checkpoint)
    ckpt = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                        lr_schedulers=lr, states={"train_state": train_state}, sd_adapter=None,
                        base_folder=folder)
    return {"model": model, "optimizers": optimizers, "lr": lr, "loader": loader,
            "it": None, "train_state": train_state, "ckpt": ckpt}


def train(job: dict[str, Any], until: int) -> None:
    """torchtitan's step order: forward/backward, wait for staging, optimizer and LR steps,
    then ``save`` (which saves on the interval)."""
    if job["it"] is None:
        job["it"] = iter(job["loader"])
    ts = job["train_state"]
    while ts.step < until:
        ts.step += 1
        batch = next(job["it"])
        job["model"](batch).square().mean().backward()
        job["ckpt"].maybe_wait_for_staging()
        job["optimizers"].step()
        job["lr"].step()
        job["optimizers"].zero_grad()
        ts.ntokens_seen += batch.numel()
        job["ckpt"].save(ts.step)


def snapshot(job: dict[str, Any]) -> dict[str, Any]:
    """Full tensors of model and optimizer state, the LR scheduler, train state, and this
    rank's dataloader state, comparable across world sizes."""
    params = dict(job["model"].named_parameters())
    opt = job["optimizers"].optimizers[0]
    return {
        "model": {n: p.full_tensor() for n, p in params.items()},
        "optim": {n: {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                      for k, v in opt.state[p].items()} for n, p in params.items()},
        "betas": opt.param_groups[0]["betas"],
        "lr": job["lr"].state_dict(),
        "train_state": job["train_state"].state_dict(),
    }


def run_and_kill(rank: int, world: int, folder: str, steps: int, ref: str) -> None:
    """Train with the ckptd manager (async with overlap), wait until the last save is written,
    record what the run held, and die by SIGKILL, as a preempted job does."""
    job = build(rank, world, folder, "ckptd")  # async_with_pinned_mem, as documented
    train(job, steps)
    job["ckpt"].maybe_wait_for_saving()
    torch.save({"state": snapshot(job), "next": next(job["it"])}, f"{ref}.{rank}")
    os.kill(os.getpid(), signal.SIGKILL)


def resume(rank: int, world: int, folder: str, manager: str, steps: int,
           checkpoint: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """Load what the folder holds and train on to ``steps``; the state, and the next batch."""
    job = build(rank, world, folder, manager, **checkpoint)
    job["ckpt"].load()
    loaded = snapshot(job)
    train(job, steps)
    job["ckpt"].maybe_wait_for_saving()
    out = snapshot(job) if steps > loaded["train_state"]["step"] else loaded
    job["ckpt"].close()
    return out, next(iter(job["loader"])) if steps == loaded["train_state"]["step"] else None
