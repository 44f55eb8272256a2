"""``ckptd plan``, ``ckptd history`` and ``ckptd demo``: thin shells over ckptd.elastic.

Registered by ``ckptd.cli`` (``_COMMAND_MODULES``); reading checkpoints goes through the CLI's
``open_ckpt``, so these commands take the same URLs as every other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd.elastic.history import ElasticPolicy, TrainingMeta
from ckptd.elastic.replan import InvalidSpec, ModelSpec, TrainingSpec
from ckptd.elastic.table import parse_world_range, plan_table, render_json, render_markdown
from ckptd.errors import CkptdError

Add = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def read_meta(url: str, storage_options: dict[str, Any] | None = None,
              ) -> tuple[int, TrainingMeta]:
    """The step and elastic metadata of a checkpoint (``ROOT`` = its latest committed step)."""
    from ckptd.cli import open_ckpt

    storage, step, manifest = open_ckpt(url, storage_options)
    return step, TrainingMeta.from_json(manifest.training, f"{storage.url} step {step}")


def read_latest_training(root: str) -> dict[str, Any] | None:
    """The latest committed checkpoint's training dict, or None when there is none yet."""
    from ckptd.cli import open_ckpt
    from ckptd.errors import CheckpointNotFound

    try:
        return dict(open_ckpt(root)[2].training)
    except CheckpointNotFound:
        return None


# ----------------------------------------------------------------------------- presentation
COLUMNS = ("step", "reason", "world", "micro", "accum", "ZeRO", "global batch", "deviation %",
           "consumed", "load s", "downtime s")


def history_rows(meta: TrainingMeta) -> list[list[str]]:
    """One row of :data:`COLUMNS` per history entry, as text."""
    def opt(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    return [[str(e.step), e.reason, str(e.world_size), str(e.micro_batch_size),
             str(e.gradient_accumulation_steps), str(e.zero_stage), str(e.global_batch_size),
             f"{e.deviation * 100:+.2f}", str(e.consumed_samples), opt(e.load_s),
             opt(e.downtime_s)] for e in meta.history]


def plot_history(meta: TrainingMeta, path: str, *, last_step: int | None = None,
                 title: str | None = None) -> None:
    """Write a PNG: world size, global batch (with the tolerance band) and loss against step,
    a dashed line at every restart. Needs matplotlib (``pip install 'ckptd[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise CkptdError("plotting needs matplotlib: pip install 'ckptd[plot]'") from e

    entries = list(meta.history)
    end = max([last_step or 0, *(s for s, _ in meta.losses), *(e.step for e in entries)])
    xs = [e.step for e in entries] + [end]
    fig, (ax_w, ax_b, ax_l) = plt.subplots(3, 1, sharex=True, figsize=(8, 7.5),
                                           gridspec_kw={"height_ratios": [1, 1, 2]})
    try:
        if entries:
            ax_w.step(xs, [e.world_size for e in entries] + [entries[-1].world_size],
                      where="post", color="tab:blue")
            ax_b.step(xs, [e.global_batch_size for e in entries]
                      + [entries[-1].global_batch_size], where="post", color="tab:green")
        ref = meta.reference.global_batch_size
        tol = meta.policy.tolerance
        ax_b.axhspan(ref * (1 - tol), ref * (1 + tol), color="tab:green", alpha=0.12,
                     label=f"reference {ref} ±{tol:.0%}")
        ax_b.legend(loc="lower right", fontsize=8)
        if meta.losses:
            ax_l.plot([s for s, _ in meta.losses], [v for _, v in meta.losses],
                      color="tab:red", linewidth=1)
        ax_w.set_ylabel("world size")
        ax_w.yaxis.get_major_locator().set_params(integer=True)
        if entries:
            ax_w.set_ylim(0, max(e.world_size for e in entries) + 1)
        ax_b.set_ylabel("global batch")
        ax_l.set_ylabel("loss")
        ax_l.set_xlabel("optimizer step")
        for entry in entries[1:]:
            for ax in (ax_w, ax_b, ax_l):
                ax.axvline(entry.step, color="gray", linestyle="--", linewidth=0.8)
        for entry in entries:
            ax_w.annotate(f"{entry.reason}: {entry.micro_batch_size}×"
                          f"{entry.gradient_accumulation_steps}, ZeRO-{entry.zero_stage}",
                          (entry.step, entry.world_size), textcoords="offset points",
                          fontsize=8, **({"xytext": (-3, 3), "ha": "right"}
                                         if entry.step > 0.7 * end else {"xytext": (3, 3)}))
        ax_w.set_title(title or f"elastic run: {len(entries)} incarnation(s), step {end}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


# ----------------------------------------------------------------------------- plan
def _tolerance(text: str) -> float:
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def _int(text: str) -> int:
    return int(float(text.replace("_", ""))) if "e" in text.lower() else int(text.replace("_", ""))


def cmd_plan(args: argparse.Namespace) -> int:
    model: ModelSpec | None = None
    previous: TrainingSpec | None = None
    policy = ElasticPolicy()
    if args.source:
        _, meta = read_meta(args.source, args.storage_options)
        model, previous, policy = meta.model, meta.reference, meta.policy
    if args.hidden_size or args.num_layers or args.num_params:
        base = model or ModelSpec(1, 1, 1)
        model = ModelSpec(args.hidden_size or base.hidden_size,
                          args.num_layers or base.num_hidden_layers,
                          args.num_params or base.num_parameters,
                          args.dtype_bytes or base.dtype_bytes)
    flags = (args.zero_stage, args.world, args.micro_batch, args.accum, args.seq_len)
    if any(f is not None for f in flags):
        if previous is None and any(f is None for f in flags):
            raise InvalidSpec("without --from, give all of --zero-stage --world --micro-batch "
                              "--accum --seq-len")
        p = previous
        previous = TrainingSpec(*(f if f is not None else getattr(p, name) for f, name in zip(
            flags, ("zero_stage", "world_size", "micro_batch_size",
                    "gradient_accumulation_steps", "sequence_length"), strict=True)))
    if model is None or previous is None:
        raise InvalidSpec("give the model (--hidden-size --num-layers --num-params) and the "
                          "previous settings as flags, or --from CKPT")
    kwargs = policy.replan_kwargs()
    for key, value in (("tolerance", args.tolerance), ("mem_limit_gib", args.mem_limit_gib),
                       ("max_micro_batch_size", args.max_micro_batch),
                       ("zero_stages", args.zero_stages)):
        if value is not None:
            kwargs[key] = value
    rows = plan_table(model, previous, parse_world_range(args.to_world), **kwargs)
    print(render_json(rows) if args.json else render_markdown(rows))
    return 0


# ----------------------------------------------------------------------------- history
def cmd_history(args: argparse.Namespace) -> int:
    step, meta = read_meta(args.ckpt, args.storage_options)
    if args.json:
        print(json.dumps({"step": step, **meta.to_json()}, indent=1))
    else:
        r = meta.reference
        print(f"step {step}, {meta.consumed_samples} samples consumed; reference global batch "
              f"{r.global_batch_size} on {r.world_size} ranks, tolerance "
              f"±{meta.policy.tolerance:.0%}")
        rows = history_rows(meta)
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(COLUMNS)]
        for row in [list(COLUMNS), ["-" * w for w in widths], *rows]:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    if args.plot:
        plot_history(meta, args.plot, last_step=step)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    from ckptd.elastic.demo import run_demo
    from ckptd.elastic.history import render_phases

    try:  # fail before minutes of demo, not after
        import matplotlib  # noqa: F401
    except ImportError:
        raise CkptdError("the demo draws history.png with matplotlib: "
                         "pip install 'ckptd[plot]'") from None
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ckptd-demo-") if own else args.workdir)
    try:
        result = run_demo(workdir, phase_steps=args.phase_steps, cooldown_s=args.cooldown_s,
                          grace_s=args.grace_s, script=args.script,
                          read_training=read_latest_training,
                          out=lambda line: print(line, flush=True,
                                                 file=sys.stderr if args.json else sys.stdout))
        step, meta = read_meta(result.ckpt)
        plot_history(meta, args.plot, last_step=step,
                     title=f"ckptd demo: {len(result.phases)} phases, step {step}")
        if args.json:
            print(json.dumps({"elapsed_s": result.elapsed_s, "exit_codes": result.exit_codes,
                              "phases": [dataclasses.asdict(p) for p in result.phases]}, indent=1))
        else:
            print(f"\ndone in {result.elapsed_s:.0f} s; {meta.consumed_samples} samples "
                  f"consumed over {step} steps; wrote {args.plot}\n")
            print(render_phases(result.phases))
    finally:
        if own and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif own:
            print(f"kept {workdir}", file=sys.stderr)
    return 0


def register(sub: Any, add: Add) -> None:
    p = add("plan", cmd_plan, "the elastic batch table for a range of world sizes")
    p.add_argument("--to-world", required=True, help="e.g. 8..800:8, 2,3,4 or 16")
    p.add_argument("--from", dest="source", metavar="CKPT",
                   help="model, reference settings and policy from this checkpoint's metadata")
    m = p.add_argument_group("model")
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--num-layers", type=int)
    m.add_argument("--num-params", type=_int, help="e.g. 4832071680 or 4.8e9")
    m.add_argument("--dtype-bytes", type=int, default=None)
    t = p.add_argument_group("previous settings")
    t.add_argument("--zero-stage", type=int)
    t.add_argument("--world", type=int)
    t.add_argument("--micro-batch", type=int)
    t.add_argument("--accum", type=int)
    t.add_argument("--seq-len", type=int)
    q = p.add_argument_group("policy (default: the checkpoint's, else ElasticPolicy())")
    q.add_argument("--tolerance", type=_tolerance, help="0.1 or 10%%")
    q.add_argument("--mem-limit-gib", type=float)
    q.add_argument("--max-micro-batch", type=int)
    q.add_argument("--zero-stages", type=lambda s: tuple(int(z) for z in s.split(",")))

    h = add("history", cmd_history, "world size, batch settings and churn over the run")
    h.add_argument("ckpt", help="ROOT (latest committed step) or ROOT/step-NNNNNNNNN")
    h.add_argument("--plot", metavar="FILE", help="write world size / global batch / loss PNG")

    d = add("demo", cmd_demo, "the elastic demo: real torchrun agents on 127.0.0.1")
    d.add_argument("--phase-steps", type=int, default=40,
                   help="steps each world trains before the next change")
    d.add_argument("--cooldown-s", type=float, default=8.0, help="scale-up cooldown")
    d.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM -> SIGKILL")
    d.add_argument("--plot", default="history.png")
    d.add_argument("--workdir", type=Path, help="keep checkpoints, events and logs here")
    d.add_argument("--keep", action="store_true", help="keep the temporary workdir")
    d.add_argument("--script", type=Path, help="the training script (default: the checkout's "
                   "integrations/torchrun/train.py)")
