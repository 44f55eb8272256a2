"""Elastic ZeRO training of a tiny transformer under ``torchrun --nnodes=MIN:MAX``, with ckptd.

One worker per process; gloo on CPU. Every incarnation (first start and each re-spawn after a
preemption or a membership change) resumes from the latest committed checkpoint, re-plans the
batch settings for the new world (``ckptd.elastic.resume``), rebuilds its flat ZeRO buffers for
that world and loads into them (resharding), and continues from the consumed-samples position::

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=run1 --max-restarts=100 \\
        --rdzv-conf=is_host=0,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        integrations/torchrun/train.py --ckpt /shared/ckpts/run1 --steps 1000

(with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment; see docs/elastic.md).
Exit status: 0 when done or when this worker received SIGTERM and saved; 75 when another rank
was preempted (so that torchrun re-spawns the survivors instead of ending the job).
"""

from __future__ import annotations

# Before anything slow: a SIGTERM during start-up is remembered and re-delivered once ckptd's
# handler is installed (the default action would kill the worker without a save).
import signal  # noqa: I001 - must run before the heavy imports below
import time

_early_sigterm: list[float] = []
signal.signal(signal.SIGTERM, lambda *_: _early_sigterm.append(time.monotonic()))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import MarkovDataset  # noqa: E402
from model import Config, forward, num_parameters, param_specs  # noqa: E402
from zero import FlatZero  # noqa: E402

import ckptd  # noqa: E402
from ckptd import elastic  # noqa: E402
from ckptd.data import GlobalOrder  # noqa: E402
from ckptd.storage.local import LocalStorage  # noqa: E402


class GatedStorage(LocalStorage):
    """A local root whose data-file writes wait until ``gate`` exists (tests use it to hold a
    save in flight at a known point; coordination through a file, bounded)."""

    def __init__(self, root: str, gate: str, timeout_s: float = 120.0) -> None:
        super().__init__(root)
        self.gate, self.timeout_s = gate, timeout_s

    def write_file(self, path: str, parts: Iterable[Any], gate: Any = None) -> int:
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {self.gate} did not open within {self.timeout_s}s")
            time.sleep(0.01)
        return super().write_file(path, parts, gate)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint root (shared by every node)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    p.add_argument("--stop-file", default=None,
                   help="end the run (final save, exit 0) after the step during which this "
                        "file appears on any rank")
    p.add_argument("--save-every", type=int, default=10, help="async checkpoint every N steps")
    p.add_argument("--events", default=None, help="append JSON-line events to this file")
    p.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM -> SIGKILL time")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1 or 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=1000,
                   help="dataset size (epochs are reshuffled by ckptd.data.GlobalOrder)")
    p.add_argument("--sample-log", default=None,
                   help="(tests) append each completed step's sample indices, per rank, to "
                        "DIR/samples-<pid>.jsonl")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr-scaling", choices=("none", "sqrt", "linear"), default="none",
                   help="scale the learning rate with global batch / reference global batch")
    g = p.add_argument_group("reference settings (what the run is configured for)")
    g.add_argument("--ref-world", type=int, default=3, help="data-parallel size")
    g.add_argument("--micro-batch", type=int, default=2)
    g.add_argument("--accum", type=int, default=2)
    g.add_argument("--zero-stage", type=int, default=1)
    g = p.add_argument_group("elastic policy")
    g.add_argument("--tolerance", type=float, default=0.10)
    g.add_argument("--mem-limit-gib", type=float, default=1.0)
    g.add_argument("--max-micro-batch", type=int, default=4)
    g.add_argument("--zero-stages", default="1,2,3")
    g.add_argument("--cooldown-s", type=float, default=0.0, help="scale-up cooldown")
    g = p.add_argument_group("model (tiny by default)")
    for name, default in vars(Config()).items():
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    g = p.add_argument_group("checkpointing")
    g.add_argument("--max-inflight", type=int, default=1)
    g.add_argument("--overlap", action="store_true", help="save_async(overlap=True)")
    g.add_argument("--keep-last", type=int, default=3)
    g.add_argument("--gate", default=None, help="(tests) data writes wait for this file")
    return p.parse_args(argv)


def groups(world: int, rank: int, tp: int) -> tuple[Any, Any]:
    """(tp_group, dp_group) of this rank; ranks ``i*tp .. i*tp+tp-1`` form a TP group."""
    if tp == 1:
        return None, None
    if world % tp:
        raise SystemExit(f"world size {world} is not divisible by --tp {tp}")
    tp_group = dp_group = None
    for i in range(world // tp):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if rank // tp == i:
            tp_group = g
    for t in range(tp):
        g = dist.new_group(list(range(t, world, tp)))
        if rank % tp == t:
            dp_group = g
    return tp_group, dp_group


class _Indexed(torch.utils.data.Dataset[tuple[int, torch.Tensor]]):
    """``dataset`` with each sample's index beside it (for the sample log)."""

    def __init__(self, dataset: MarkovDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.dataset[i]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = args.tp
    tp_group, dp_group = groups(world, rank, tp)
    dp, dp_rank, tp_rank = world // tp, rank // tp, rank % tp
    cfg = Config(**{k: getattr(args, k) for k in vars(Config())})

    storage = GatedStorage(args.ckpt, args.gate) if args.gate else None
    ckpt = ckptd.init(args.ckpt, compression=None, threads=os.cpu_count() or 1,
                      keep_last=args.keep_last, max_inflight=args.max_inflight, storage=storage)
    reference = elastic.TrainingSpec(zero_stage=args.zero_stage, world_size=args.ref_world,
                                     micro_batch_size=args.micro_batch,
                                     gradient_accumulation_steps=args.accum,
                                     sequence_length=cfg.seq_len)
    model_spec = elastic.ModelSpec(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                                   num_parameters=num_parameters(cfg), dtype_bytes=4)
    policy = elastic.ElasticPolicy(
        tolerance=args.tolerance, mem_limit_gib=args.mem_limit_gib,
        max_micro_batch_size=args.max_micro_batch,
        zero_stages=tuple(int(z) for z in args.zero_stages.split(",")),
        scale_up_cooldown_s=args.cooldown_s)
    run = elastic.resume(ckpt, reference=reference, model=model_spec, policy=policy,
                         world_size=dp, dp_rank=dp_rank, grace_s=args.grace_s,
                         events=args.events)
    if _early_sigterm:
        os.kill(os.getpid(), signal.SIGTERM)  # now ckptd's handler records it
    t = run.training
    zero = FlatZero(param_specs(cfg, tp, tp_rank), stage=t.zero_stage, dp_size=dp,
                    dp_rank=dp_rank, dp_group=dp_group, seed=args.seed)
    state = zero.state()
    if run.load(state) is not None:
        zero.after_load()
    dataset = MarkovDataset(cfg.vocab_size, cfg.seq_len, args.samples, args.seed)
    # the data position is part of the checkpoint: this rank's micro-batches continue the
    # global order where the saved step stopped, whatever the new world
    order = GlobalOrder(len(dataset), seed=args.seed)
    batches = iter(DataLoader(_Indexed(dataset), batch_sampler=run.batch_sampler(order)))
    sample_log = (open(os.path.join(args.sample_log, f"samples-{os.getpid()}.jsonl"), "a")
                  if args.sample_log else None)
    scale = t.global_batch_size / run.meta.reference.global_batch_size
    lr_factor = {"none": 1.0, "sqrt": math.sqrt(scale), "linear": scale}[args.lr_scaling]
    handle: ckptd.SaveHandle | None = None
    step_buf = torch.zeros(2, dtype=torch.float64)  # [loss sum, stop requested], all-reduced
    while run.step < args.steps:
        loss_sum, indices = 0.0, []
        for _micro in range(t.gradient_accumulation_steps):
            ids, rows = next(batches)
            indices += ids.tolist()
            x, y = rows[:, :-1], rows[:, 1:]
            per_sample = forward(zero.views, x, y, cfg, tp, tp_group)
            zero.accumulate(per_sample.sum() / t.global_batch_size)
            loss_sum += float(per_sample.detach().sum())
            if ckptd.preempted():  # a micro-batch boundary; the same answer on every rank
                return run.save_on_preemption(state).exit_code
        if handle is not None:
            handle.wait_staged()  # overlap=True: the state must not change before it is staged
        lr = args.lr * lr_factor * min(1.0, (run.step + 1) / args.warmup)
        zero.step(lr, run.step + 1)
        step_buf[0] = loss_sum
        step_buf[1] = 1.0 if args.stop_file and os.path.exists(args.stop_file) else 0.0
        dist.all_reduce(step_buf)  # over the world: TP ranks hold equal losses, hence / tp
        run.step_done(float(step_buf[0]) / tp / t.global_batch_size)
        if sample_log is not None and tp_rank == 0:
            sample_log.write(json.dumps({"step": run.step, "rank": dp_rank, "t": time.time(),
                                         "samples": indices}) + "\n")
            sample_log.flush()
        if step_buf[1] > 0:
            break
        if run.step % args.save_every == 0 and run.step < args.steps:
            handle = run.save_async(state, overlap=args.overlap)
    return run.finish(state)


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    elastic.exit_now(code)  # every save is committed: skip seconds of interpreter teardown
