"""A small Lightning training job on CPU (gloo) under torchrun, for
tests/test_integration_lightning.py.

Lightning's own ``Trainer`` with ``DDPStrategy``, ``ModelCheckpoint`` and ``ckpt_path="last"``,
and the checkpoint plugin configured as docs/integrations.md shows (its ``CkptdCheckpointIO(...)``
and ``ModelCheckpoint(...)`` expressions are read from the doc and evaluated). The job records
what each rank holds — model, AdamW state, LR scheduler, loop state, epoch and step — at the
start of one epoch and at the end of training:

    python -m torch.distributed.run --nproc-per-node 2 ... tests/lightning_job.py \\
        --workdir DIR --epochs 4 --tag ref [--resume] [--stop-at 2] [--io doc|lightning-async]

``--stop-at E``: at the start of epoch E, once the checkpoints before it are committed, every
rank records its state, prints ``READY <pid>`` and waits to be killed (SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"


def documented(name: str, namespace: dict[str, Any]) -> Any:
    """The ``name(...)`` expression of the Lightning section of docs/integrations.md, evaluated."""
    text = DOC.read_text()
    section = text[text.index("## Lightning"):]
    found = re.search(rf"{name}\((?:[^()]|\([^()]*\))*\)", section)
    assert found is not None, f"no {name}(...) in the Lightning section of {DOC}"
    return eval(found.group(0), namespace)


def main() -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy

    from ckptd.integrations.lightning import CkptdCheckpointIO

    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-at", type=int)
    ap.add_argument("--record-at", type=int, default=2)
    ap.add_argument("--io", choices=["doc", "lightning-async"], default="doc")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    # the records below go here too: made now, not by the checkpoint's first write (with Lightning's
    # async wrapper and the node agent that write may come after the record at epoch 2's start)
    workdir.mkdir(parents=True, exist_ok=True)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                           torch.nn.Linear(8, 1))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.8, 0.95))
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def record(trainer: Any, module: Any, when: str) -> None:
        state = {
            "model": {k: v.clone() for k, v in module.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(),
            "lr_scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "loops": trainer.fit_loop.state_dict(),
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
        }
        torch.save(state, workdir / f"{args.tag}-{when}-{trainer.global_rank}.pt")

    class Record(Callback):  # type: ignore[misc]
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            if trainer.current_epoch == args.record_at:
                record(trainer, module, f"epoch{args.record_at}")
            if trainer.current_epoch == args.stop_at:
                io = trainer.strategy.checkpoint_io
                if trainer.global_rank == 0:
                    io.wait()  # the async save of the epoch before is committed
                trainer.strategy.barrier("recorded")
                # one write(2) of a few bytes on a pipe is atomic: the two ranks' lines never mix
                os.write(1, f"READY {os.getpid()}\n".encode())
                threading.Event().wait()  # until the test kills the job

        def on_train_end(self, trainer: Any, module: Any) -> None:
            record(trainer, module, "end")

    L.seed_everything(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = DataLoader(data, batch_size=4, shuffle=True)
    namespace = {"CkptdCheckpointIO": CkptdCheckpointIO, "ModelCheckpoint": ModelCheckpoint}
    io = documented("CkptdCheckpointIO", namespace)
    if args.io == "lightning-async":  # Lightning's own async wrapper around a synchronous one
        io = AsyncCheckpointIO(CkptdCheckpointIO())
    checkpoints = documented("ModelCheckpoint", namespace)
    checkpoints.dirpath = str(workdir / "checkpoints")
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
        max_epochs=args.epochs, plugins=[io], callbacks=[Record(), checkpoints],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, deterministic=True)
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last" if args.resume else None)


if __name__ == "__main__":
    sys.exit(main())
