"""``ckptd plan``, ``ckptd history`` and ``ckptd demo``: thin shells over ``ckptd.elastic``.

``plan`` and ``history`` import no torch: the planner is arithmetic, and manifests are read to
their heads (``ckptd.catalog.read_head``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ckptd import catalog
from ckptd.cli.common import Add, add_ckpt, ckpt_url, human, table
from ckptd.elastic.history import ElasticPolicy, HistoryEntry, NotElastic, TrainingMeta
from ckptd.elastic.specs import InvalidSpec, ModelSpec, TrainingSpec, infer_model
from ckptd.elastic.table import parse_world_range, plan_table, render_json, render_markdown
from ckptd.errors import CheckpointNotFound, CkptdError
from ckptd.manifest import layout
from ckptd.manifest.parse import Head
from ckptd.storage import Storage


def register(add: Add) -> None:
    p = add("plan", cmd_plan, "the elastic batch table for a range of world sizes")
    p.add_argument("--to-world", required=True, metavar="RANGE",
                   help="world sizes to plan for: 8..800:8 (start..stop:step), 2,3,4 or 16")
    p.add_argument("--from", dest="source", metavar="CKPT",
                   help="start from this checkpoint: its elastic metadata (model, reference "
                        "settings, policy), or for any other checkpoint its world size and a "
                        "model inferred from its tensors")
    m = p.add_argument_group("model")
    m.add_argument("--hidden-size", type=int, help="hidden size")
    m.add_argument("--num-layers", type=int, help="number of transformer layers")
    m.add_argument("--num-params", type=_int, help="parameters, e.g. 4832071680 or 4.8e9")
    m.add_argument("--dtype-bytes", type=int, default=None,
                   help="bytes per parameter in training (default 2)")
    t = p.add_argument_group("previous settings")
    t.add_argument("--zero-stage", type=int, help="ZeRO stage (1, 2 or 3)")
    t.add_argument("--world", type=int, help="world size")
    t.add_argument("--micro-batch", type=int, help="micro-batch size per rank")
    t.add_argument("--accum", type=int, help="gradient-accumulation steps")
    t.add_argument("--seq-len", type=int, help="sequence length")
    q = p.add_argument_group("policy (default: the checkpoint's, else ElasticPolicy())")
    q.add_argument("--tolerance", type=_tolerance, help="global batch band: 0.1 or 10%%")
    q.add_argument("--mem-limit-gib", type=float, help="memory per GPU, GiB")
    q.add_argument("--max-micro-batch", type=int, help="largest micro-batch size")
    q.add_argument("--zero-stages", type=lambda s: tuple(int(z) for z in s.split(",")),
                   help="stages to consider, e.g. 1,2,3")

    h = add("history", cmd_history, "steps, world sizes and sizes of any root; batch settings "
                                    "and churn where the elastic metadata has them")
    add_ckpt(h)
    h.add_argument("--plot", metavar="FILE",
                   help="write world size / global batch / loss as a PNG (a checkpoint of an "
                        "elastic run: any other is an error, before anything is printed)")

    d = add("demo", cmd_demo, "the elastic demo: real torchrun agents on 127.0.0.1")
    d.add_argument("--phase-steps", type=int, default=40,
                   help="steps each world trains before the next change (default 40)")
    d.add_argument("--cooldown-s", type=float, default=8.0, help="scale-up cooldown (s)")
    d.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM -> SIGKILL (s)")
    d.add_argument("--no-agent", dest="agents", action="store_false",
                   help="no ckptd node agents: every restart reads from storage")
    d.add_argument("--plot", type=Path, metavar="FILE",
                   help="where to draw the history (default: history.png in the work directory)")
    d.add_argument("--workdir", type=Path,
                   help="keep checkpoints, events and logs here (default: a temporary "
                        "directory, removed at the end but for its history.png unless --keep)")
    d.add_argument("--keep", action="store_true", help="keep the temporary workdir")
    d.add_argument("--script", type=Path, help="the training script (default: the checkout's "
                   "integrations/torchrun/train.py)")


def _tolerance(text: str) -> float:
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def _int(text: str) -> int:
    return int(float(text.replace("_", ""))) if "e" in text.lower() else int(text.replace("_", ""))


# ----------------------------------------------------------------------------- reading
def _open(url: str, storage_options: dict[str, Any] | None) -> tuple[Storage, Head]:
    """Storage and manifest head of ``ROOT`` (latest) or ``ROOT/step-N``."""
    storage, step = catalog.open_url(url, storage_options)
    return storage, catalog.read_head(storage, step)


def read_meta(url: str, storage_options: dict[str, Any] | None = None,
              ) -> tuple[int, TrainingMeta]:
    """The step and elastic metadata of a checkpoint (``ROOT`` = its latest committed step)."""
    storage, h = _open(url, storage_options)
    return h.step, TrainingMeta.from_json(h.training, f"{storage.url} step {h.step}")


def read_latest_training(root: str) -> dict[str, Any] | None:
    """The latest committed checkpoint's training dict, or None when there is none yet."""
    try:
        return _open(root, None)[1].training
    except CheckpointNotFound:
        return None


# ----------------------------------------------------------------------------- plan
def cmd_plan(args: argparse.Namespace) -> int:
    model: ModelSpec | None = None
    previous: TrainingSpec | None = None
    policy = ElasticPolicy()
    saved_world: int | None = None
    if args.source:
        storage, h = _open(ckpt_url(args, args.source), args.storage_options)
        try:
            meta = TrainingMeta.from_json(h.training, args.source)
            model, previous, policy = meta.model, meta.reference, meta.policy
        except NotElastic:
            model = infer_model(h.shapes)
            saved_world = h.world_size
            print(f"{storage.url}/{layout.step_dir(h.step)} has no elastic metadata: model "
                  f"inferred from its tensors (hidden {model.hidden_size}, "
                  f"{model.num_hidden_layers} layers, {model.num_parameters:.3g} parameters), "
                  f"previous world size {saved_world} from its manifest", file=sys.stderr)
    if args.hidden_size or args.num_layers or args.num_params:
        base = model or ModelSpec(1, 1, 1)
        model = ModelSpec(args.hidden_size or base.hidden_size,
                          args.num_layers or base.num_hidden_layers,
                          args.num_params or base.num_parameters,
                          args.dtype_bytes or base.dtype_bytes)
    world = args.world if args.world is not None else saved_world
    flags = (args.zero_stage, world, args.micro_batch, args.accum, args.seq_len)
    names = ("zero_stage", "world_size", "micro_batch_size", "gradient_accumulation_steps",
             "sequence_length")
    if any(f is not None for f in flags):
        if previous is None and any(f is None for f in flags):
            missing = [f"--{n}" for n, f in zip(("zero-stage", "world", "micro-batch", "accum",
                                                 "seq-len"), flags, strict=True) if f is None]
            raise InvalidSpec("without --from, give all of --zero-stage --world --micro-batch "
                              f"--accum --seq-len (missing: {' '.join(missing)}; a --from "
                              "checkpoint without elastic metadata gives only --world)")
        p = previous
        previous = TrainingSpec(*(f if f is not None else getattr(p, n)
                                  for f, n in zip(flags, names, strict=True)))
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
HISTORY = ("step", "reason", "world", "micro", "accum", "ZeRO", "global batch", "deviation %",
           "consumed", "epoch", "load s", "read from memory / peer / storage", "downtime s",
           "resumed step safe via")


def history_rows(meta: TrainingMeta) -> list[list[str]]:
    """One row of :data:`HISTORY` per elastic history entry, as text."""
    def opt(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    def epoch(consumed: int) -> str:
        e = meta.epoch(consumed)
        return "—" if e is None else str(e)

    def sources(e: HistoryEntry) -> str:
        parts = (e.bytes_from_memory, e.bytes_from_peer, e.bytes_from_storage)
        return "—" if None in parts else " / ".join(human(n or 0) for n in parts)

    return [[str(e.step), e.reason, str(e.world_size), str(e.micro_batch_size),
             str(e.gradient_accumulation_steps), str(e.zero_stage), str(e.global_batch_size),
             f"{e.deviation * 100:+.2f}", str(e.consumed_samples), epoch(e.consumed_samples),
             opt(e.load_s), sources(e), opt(e.downtime_s), e.safe_via or "—"]
            for e in meta.history]


def step_rows(storage: Storage) -> list[dict[str, Any]]:
    """What every committed step's manifest knows, for any root (oldest first, commit order):
    world size, size, time, and the batch settings where elastic metadata has them."""
    out = []
    for c in catalog.committed(storage):
        h = catalog.read_head(storage, c.step)
        training = h.training
        raw_spec = training.get("spec")
        spec: dict[str, Any] = raw_spec if isinstance(raw_spec, dict) else {}
        out.append({
            "step": c.step, "world_size": h.world_size, "nbytes": h.nbytes, "created": h.created,
            "micro_batch_size": spec.get("micro_batch_size"),
            "gradient_accumulation_steps": spec.get("gradient_accumulation_steps"),
            "zero_stage": spec.get("zero_stage"),
            "consumed_samples": training.get("consumed_samples")})
    return out


def cmd_history(args: argparse.Namespace) -> int:
    storage, h = _open(ckpt_url(args), args.storage_options)
    step = h.step
    try:
        meta: TrainingMeta | None = TrainingMeta.from_json(h.training,
                                                            f"{storage.url} step {step}")
    except NotElastic:
        meta = None
    if args.plot and meta is None:  # an error, not a table and then an error
        raise NotElastic(f"{storage.url} step {step} has no elastic metadata (it was not saved "
                         "by ckptd.elastic): no history to plot (without --plot, `ckptd "
                         "history` lists its steps)")
    steps = step_rows(storage)
    if args.json:
        out: dict[str, Any] = {"step": step, "steps": steps}
        out.update(meta.to_json() if meta is not None else {"elastic": None})
        print(json.dumps(out, indent=1))
    else:
        if meta is not None:
            r = meta.reference
            print(f"step {step}, {meta.consumed_samples} samples consumed; reference global "
                  f"batch {r.global_batch_size} on {r.world_size} ranks, tolerance "
                  f"±{meta.policy.tolerance:.0%}")
            rows = history_rows(meta)
            widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(HISTORY)]
            for row in [list(HISTORY), ["-" * w for w in widths], *rows]:
                print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
            print()

        def cell(v: Any) -> str:
            return "—" if v is None else str(v)

        print(f"committed steps under {storage.url}:")
        print(table([[r["step"], r["world_size"], human(r["nbytes"]),
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"])),
                      cell(r["micro_batch_size"]), cell(r["gradient_accumulation_steps"]),
                      cell(r["zero_stage"]), cell(r["consumed_samples"])] for r in steps],
                    ["step", "world", "size", "saved", "micro", "accum", "ZeRO", "consumed"]))
        if meta is None:
            print(f"step {step} has no elastic training metadata (it was not saved by "
                  "ckptd.elastic): no batch history to show")
    if args.plot and meta is not None:
        from ckptd.elastic.plot import plot_history

        plot_history(meta, args.plot, last_step=step)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    import dataclasses
    import tempfile

    from ckptd.demo.timeline import run_demo
    from ckptd.elastic.events import render_phases
    from ckptd.elastic.plot import plot_history

    try:  # fail before minutes of demo, not after
        import matplotlib  # noqa: F401
    except ImportError:
        raise CkptdError("the demo draws history.png with matplotlib: "
                         "pip install 'ckptd[plot]'") from None
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ckptd-demo-") if own else args.workdir)
    png = args.plot if args.plot is not None else workdir / "history.png"
    say = sys.stderr if args.json else sys.stdout
    tidy = own and not args.keep
    if tidy:
        what = "all but history.png" if args.plot is None else "it"
        print(f"working directory {workdir} (temporary: {what} removed at the end; --keep or "
              "--workdir DIR keeps it)", file=say, flush=True)
    try:
        result = run_demo(workdir, phase_steps=args.phase_steps, cooldown_s=args.cooldown_s,
                          grace_s=args.grace_s, script=args.script,
                          read_training=read_latest_training, agents=args.agents,
                          out=lambda line: print(line, flush=True, file=say))
        step, meta = read_meta(result.ckpt)
        plot_history(meta, str(png), last_step=step,
                     title=f"ckptd demo: {len(result.phases)} phases, step {step}")
        if args.json:
            print(json.dumps({"elapsed_s": result.elapsed_s, "exit_codes": result.exit_codes,
                              "workdir": str(workdir), "kept": not tidy, "plot": str(png),
                              "phases": [dataclasses.asdict(p) for p in result.phases]}, indent=1))
        else:
            print(f"\ndone in {result.elapsed_s:.0f} s; {meta.consumed_samples} samples "
                  f"consumed over {step} steps; wrote {png}\n")
            print(render_phases(result.phases))
    finally:
        if tidy:
            kept = remove_all_but(workdir, png)
            print(f"removed {workdir} (pass --keep or --workdir DIR to keep it)" if kept is None
                  else f"removed the checkpoints, events and logs in {workdir} (pass --keep or "
                  f"--workdir DIR to keep them); the plot stays: {kept}", file=say)
        else:
            print(f"checkpoints, events and logs are in {workdir}", file=say)
    return 0


def remove_all_but(workdir: Path, keep: Path) -> Path | None:
    """Remove ``workdir`` but for the file ``keep``, if it is there (its path is returned);
    else remove all of it (None)."""
    import shutil

    if keep.parent.resolve() != workdir.resolve() or not keep.is_file():
        shutil.rmtree(workdir, ignore_errors=True)
        return None
    for entry in workdir.iterdir():
        if entry.name == keep.name:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return keep
