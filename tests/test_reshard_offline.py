"""``ckptd reshard`` through every pair of the reshard matrix: each layout of
``transformer_state`` is saved once; for each target layout, every saved checkpoint is
rewritten for the target world with the target's layout file (``test_layouts.layout_doc``), then
one multi-process run loads all of them on the target ranks: bit-exact, padding untouched,
values and per-rank values carried — and each rank reads its data in one range per file it
owns, since the layout file describes exactly the pieces the target state asks for.

Also: the dry run's report, the training metadata re-planned with ``elastic.replan``, and an
offline reshard that holds its memory budget.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import tracemalloc
from collections import defaultdict
from pathlib import Path
from typing import Any

import multirank
import pytest
import torch
import transformer_state as ts
from test_layouts import layout_text
from test_reshard_matrix import (
    LAYOUT_NAMES,
    LOAD_SETTINGS,
    SAVE_SETTINGS,
    TARGETS,
    load_problems,
)
from transformer_state import LAYOUTS, build_state

import ckptd
import ckptd.config
from ckptd.cli import main
from ckptd.loader.load import last_stats
from ckptd.manifest import decode
from ckptd.manifest import layout as L
from ckptd.storage import open_storage

RUN_TIMEOUT_S = 150.0
PG_TIMEOUT_S = 30.0
# rewritten with --compression zstd into tmp_path (the others: raw, into tmpfs when there is one)
COMPRESSED_TARGETS = {"dp2_zero1", "tp2_pp2", "dtensor_dp3"}
# the default run rewrites the sources for three targets (plain; TP x PP x ZeRO-3; DTensor,
# compressed); the matrix's other default targets are `slow` here (CI time): test_reshard_matrix
# loads every source into them online
OFFLINE_DEFAULT = {"single", "tp2_pp2_dp2_zero3", "dtensor_dp3"}
OFFLINE_TARGETS = [pytest.param(p.values[0], marks=p.marks if p.values[0] in OFFLINE_DEFAULT
                                else pytest.mark.slow) for p in TARGETS]


def _save_in_process(layout_name: str, root: str) -> None:
    """One process stands for every rank (saving needs no collectives)."""
    layout = LAYOUTS[layout_name]
    kwargs, tunables = SAVE_SETTINGS.get(layout_name, ({}, {}))
    ref = ts.reference()
    with ckptd.config.override(**tunables):
        ckpts = [ckptd.Checkpointer(root, rank=r, world_size=layout.world_size, run_id="sim",
                                    **kwargs) for r in range(layout.world_size)]
        try:
            handles = [c.save_async(build_state(layout, r, ref).state, step=ts.STEP)
                       for r, c in enumerate(ckpts)]
            for h in handles:
                h.result()
        finally:
            for c in ckpts:
                c.close()


def _save_worker(rank: int, world: int, layout_name: str, root: str) -> None:
    kwargs, tunables = SAVE_SETTINGS.get(layout_name, ({}, {}))
    with ckptd.config.override(**tunables), ckptd.Checkpointer(root, **kwargs) as ck:
        ck.save(build_state(LAYOUTS[layout_name], rank, ts.reference()).state, step=ts.STEP)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("sources")
    out = {}
    for name in LAYOUT_NAMES:
        root = str(base / name)
        if LAYOUTS[name].dtensor:  # DTensors need a process group
            multirank.run(_save_worker, LAYOUTS[name].world_size, name, root,
                          timeout=RUN_TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)
        else:
            _save_in_process(name, root)
        out[name] = root
    return out


def _fast_dir(fallback: Path) -> Path:
    """A fresh directory on tmpfs when there is one (fsync costs nothing there)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path(tempfile.mkdtemp(prefix="ckptd-reshard-", dir="/dev/shm"))
    return fallback


def _own_files(root: str, rank: int) -> int:
    m = decode(open_storage(root).read_bytes(L.manifest_path(ts.STEP)), root)
    return len({c.file for e in m.tensors.values() for c in e.chunks if c.rank == rank})


def _coalesced(root: str, rank: int) -> int:
    """Chunks another rank wrote that hold a frame of this rank's (the reshard coalesced the
    boxes of a group of ranks: a frame each)."""
    m = decode(open_storage(root).read_bytes(L.manifest_path(ts.STEP)), root)
    return sum(1 for e in m.tensors.values() for c in e.chunks
               if c.rank != rank and c.length > c.frame_bytes)


def _load_worker(rank: int, world: int, target: str, roots: list[tuple[str, str]],
                 ) -> dict[str, list[str]]:
    layout = LAYOUTS[target]
    expected = build_state(layout, rank, ts.reference(), padding=ts.SENTINEL)
    out: dict[str, list[str]] = {}
    for source, root in roots:
        dst = build_state(layout, rank, None)
        with (ckptd.config.override(**LOAD_SETTINGS.get(target, {})),
              ckptd.Checkpointer(root, rank=rank, world_size=world) as ck):
            result = ck.load(dst.state, strict=True)
        problems = load_problems(source, layout, rank, dst, expected, result)
        stats = last_stats()
        files = _own_files(root, rank)
        if stats is None:
            problems.append(f"rank {rank}: no load statistics")
        elif not files <= stats.runs <= files + _coalesced(root, rank):
            problems.append(f"rank {rank}: reads {stats.runs} contiguous runs, owns {files} "
                            f"files, reads from {_coalesced(root, rank)} coalesced chunks")
        out[source] = problems
    return out


@pytest.mark.parametrize("target", OFFLINE_TARGETS)
def test_every_layout_resharded_offline_loads_bit_exact_reading_one_run_per_file(
    target: str, sources: dict[str, str], tmp_path: Path
) -> None:
    lay = LAYOUTS[target]
    fmt = "json" if LAYOUT_NAMES.index(target) % 2 else "toml"
    layout_file = tmp_path / f"{target}.{fmt}"
    layout_file.write_text(layout_text(lay, fmt))
    extra = ["--compression", "zstd"] if target in COMPRESSED_TARGETS else []
    roots = []
    scratch = _fast_dir(tmp_path)
    for source in LAYOUT_NAMES:
        # mostly into tmpfs (its fsync is free: 256 reshards stay fast), some into tmp_path
        out = str((tmp_path if target in COMPRESSED_TARGETS else scratch) / source)
        # every small replicated box in every holder's files (one run per file), whatever its
        # share: in this tiny model norms and biases are far above the default 1 %
        with ckptd.config.override(replicate_max_share=float("inf")):
            rc = main(["reshard", sources[source], "--to-world", str(lay.world_size),
                       "--layout", str(layout_file), "--out", out, "--threads", "2", *extra])
        assert rc == 0, f"{source} -> {target}: reshard exited {rc}"
        roots.append((source, out))
    try:
        per_rank = multirank.run(_load_worker, lay.world_size, target, roots,
                                 timeout=RUN_TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)
    finally:
        if scratch != tmp_path:
            shutil.rmtree(scratch, ignore_errors=True)
    problems: dict[str, list[str]] = defaultdict(list)
    for results in per_rank:
        for source, lines in results.items():
            problems[source] += lines
    bad = [f"{s} -> {target}: {line}" for s, lines in problems.items() for line in lines]
    assert bad == [], f"{len(bad)} problems:\n" + "\n".join(bad[:40])


def test_dry_run_reports_per_rank_reads_and_writes_nothing(sources: dict[str, str],
                                                           tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "never"
    assert main(["reshard", sources["tp2_dp2_zero1"], "--to-world", "8", "--tp", "2", "--pp",
                 "2", "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ranges from the original" in text and "would read" in text
    assert not out.exists()
    assert main(["reshard", sources["single"], "--to-world", "3", "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2]
    # every target rank holds the whole (replicated) state, written once, by rank 0
    assert all(r["read_bytes"] >= r["write_bytes"] for r in report["ranks"])
    assert report["ranks"][0]["write_bytes"] > 0 and report["ranks"][0]["peak_bytes"] > 0


@pytest.mark.usefixtures("clean_sigterm")
def test_a_reshard_of_an_elastic_run_is_resumed_as_a_restart_and_shown_in_history(
    tmp_path: Path, capsys: Any
) -> None:
    """An elastic run (3 ranks, then 2) resharded offline for 4: the re-planned settings go
    into the run's own metadata, so ``elastic.resume()`` on 4 ranks continues with them (a
    restart, not a re-plan) and ``ckptd history`` lists the reshard."""
    from ckptd import elastic

    root, dest = str(tmp_path / "run"), str(tmp_path / "dst")
    model = elastic.ModelSpec(hidden_size=32, num_hidden_layers=2, num_parameters=20_000)
    reference = elastic.TrainingSpec(1, 3, 2, 2, 16)
    policy = elastic.ElasticPolicy(tolerance=0.1, mem_limit_gib=1.0, max_micro_batch_size=4)
    for world, steps in ((3, 4), (2, 3)):
        with ckptd.Checkpointer(root, rank=0, world_size=1) as ckpt:
            run = elastic.resume(ckpt, reference=reference, model=model, policy=policy,
                                 world_size=world)
            state = {"model": {"w": torch.arange(24.0).reshape(6, 4)}}
            run.load(state)
            for _ in range(steps):
                run.step_done(loss=1.0)
            run.save(state)
    assert main(["reshard", root, "--to-world", "4", "--out", dest]) == 0
    assert "| 4 |" in capsys.readouterr().out
    with ckptd.Checkpointer(dest, rank=0, world_size=1) as ckpt:
        run = elastic.resume(ckpt, reference=reference, model=model, policy=policy,
                             world_size=4)
        dst = {"model": {"w": torch.zeros(6, 4)}}
        run.load(dst)
        training = ckpt.read_manifest(ckpt.latest_step()).training
    assert torch.equal(dst["model"]["w"], torch.arange(24.0).reshape(6, 4))
    reasons = [h["reason"] for h in training["history"]]
    assert reasons == ["start", "scale-down", "reshard"]
    assert run.step == 7 and run.training.world_size == 4 and run.entry.reason == "restart"
    assert run.training == elastic.TrainingSpec.from_json(training["spec"])
    assert abs(run.training.global_batch_size - reference.global_batch_size) <= 0.1 * 12
    assert main(["history", dest]) == 0
    assert "reshard" in capsys.readouterr().out


def test_offline_reshard_holds_its_memory_budget(tmp_path: Path) -> None:
    """4 MiB of tensors, a 1 MiB budget: everything the reshard allocates — arenas (numpy, so
    traced), read buffers, decoded frames, and its plans and manifests (~1 MiB here) — stays
    under twice the budget: the data it holds does not grow with the checkpoint."""
    root, dest = str(tmp_path / "src"), str(tmp_path / "dst")
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1024, 512, generator=g), "v": torch.randn(512, 512, generator=g)}
    with ckptd.config.override(frame_bytes=64 << 10), ckptd.Checkpointer(
            root, compression="zstd") as ck:
        ck.save(state, step=1)
    budget = 1 << 20
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        assert main(["reshard", root, "--to-world", "3", "--out", dest, "--budget", str(budget),
                     "--threads", "2", "--compression", "none"]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * budget, f"peak traced memory {peak} with a budget of {budget}"
    with ckptd.Checkpointer(dest, world_size=1, rank=0) as ck:
        dst = {k: torch.zeros_like(v) for k, v in state.items()}
        ck.load(dst)
    assert all(torch.equal(dst[k], state[k]) for k in state)


def test_source_and_destination_may_be_different_urls(tmp_path: Path) -> None:
    """memory:// (an fsspec backend: ranged reads through Storage.read_ranges) -> local."""
    src, dest = "memory://ckptd-reshard-src", str(tmp_path / "dst")
    state = {"w": torch.arange(60.0).reshape(12, 5), "n": torch.ones(3)}
    try:
        with ckptd.Checkpointer(src) as ck:
            ck.save(state, step=3)
        assert main(["reshard", src, "--to-world", "2", "--out", dest]) == 0
    finally:
        open_storage(src).remove("")
    with ckptd.Checkpointer(dest, rank=1, world_size=2, run_id="t") as ck:
        dst = {"w": ckptd.Shard(torch.zeros(6, 5), (12, 5), (6, 0)), "n": torch.zeros(3)}
        ck.load(dst, strict=False)
    assert torch.equal(dst["w"].local, state["w"][6:]) and torch.equal(dst["n"], state["n"])


def test_a_bad_layout_fails_the_command_with_the_tensor_and_the_rule(
    sources: dict[str, str], tmp_path: Path, capsys: Any
) -> None:
    layout = tmp_path / "tp3.toml"
    layout.write_text("[parallel]\ntp = 3\n[[rule]]\nmatch = '*.attn.o.weight'\ntp_dim = 1\n"
                      "[[rule]]\nmatch = '*'\nreplicated = true\n")
    out = tmp_path / "never"
    assert main(["reshard", sources["dp2"], "--to-world", "6", "--layout", str(layout),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptd reshard: error: layout tp3.toml: model/layers.0.attn.o.weight "
                          "[8, 8]: rule 1 (match '*.attn.o.weight', tp_dim 1): dim 1 of size 8 "
                          "does not divide by tp 3")
    assert not out.exists()


def test_reshard_into_a_root_a_job_trains_into_is_refused_and_the_job_keeps_it(
    tmp_path: Path, capsys: Any
) -> None:
    """``ckptd reshard SRC --out LIVE`` where a job is training: refused, naming the run that
    owns LIVE; the job's next save commits and is the latest (before, the reshard took the
    root over with a generation-0 step that never became latest, and the job's next save
    failed with ForeignWriter)."""
    src, live = str(tmp_path / "src"), str(tmp_path / "live")
    with ckptd.Checkpointer(src, rank=0, world_size=1) as c:
        c.save({"w": torch.arange(8.0)}, step=5)
    job = ckptd.Checkpointer(live, rank=0, world_size=1, run_id="training-job")
    try:
        job.save({"w": torch.ones(8)}, step=1)
        capsys.readouterr()
        assert main(["reshard", src, "--to-world", "2", "--out", live]) != 0
        assert "owned by run training-job already" in capsys.readouterr().err
        assert job.save({"w": torch.full((8,), 2.0)}, step=2).step == 2  # no ForeignWriter
        assert job.latest_step() == 2
        assert not os.path.exists(os.path.join(live, L.step_dir(5)))
    finally:
        job.close()


def _save_zero_like(rank: int, world: int, root: str, params_sharded: str) -> None:
    """2 ranks: the optimizer state sharded by rows; the parameters whole on every rank
    (``params_sharded="none"``: ZeRO 1), or one of two sharded too (``"one"``: neither)."""
    w, b = torch.arange(24.0).view(6, 4), torch.arange(6.0)
    rows = slice(3 * rank, 3 * rank + 3)
    model: dict[str, Any] = {"w": w, "b": b}
    if params_sharded == "one":
        model["w"] = ckptd.Shard(w[rows].clone(), (6, 4), (3 * rank, 0))
    optim = {"state": {"w": {"exp_avg": ckptd.Shard(w[rows] * 2, (6, 4), (3 * rank, 0))},
                       "b": {"exp_avg": ckptd.Shard(b[rows] * 2, (6,), (3 * rank,))}}}
    with ckptd.Checkpointer(root, keep_last=1) as ck:
        ck.save({"model": model, "optim": optim}, step=1)


@pytest.mark.parametrize(("params_sharded", "said", "zero"), [
    ("none", "ZeRO 1 from the source layout: the optimizer state was saved sharded over 2 ranks, "
             "the parameters whole", 1),
    ("one", "ZeRO 0: the source layout cannot tell: 1 of 2 parameter tensors and 2 of 2 "
            "optimizer tensors were saved sharded", 0),
])
def test_reshard_takes_the_zero_stage_from_the_source_layout_or_says_why_not(
        tmp_path, capsys, params_sharded, said, zero):
    root = str(tmp_path / "root")
    multirank.run(_save_zero_like, 2, root, params_sharded)
    assert main(["reshard", root, "--to-world", "3", "--dry-run", "--json"]) == 0
    out = capsys.readouterr()
    assert said in out.err and json.loads(out.out)["zero"] == zero


def _fsdp2(full: torch.Tensor, rank: int, world: int) -> ckptd.Shard:
    """FSDP2's dim-0 shard of ``full`` on ``rank`` (ceil-sized; the last ranks may hold none)."""
    per = -(-full.shape[0] // world)
    a = min(full.shape[0], rank * per)
    b = min(full.shape[0], a + per)
    return ckptd.Shard(full[a:b].clone(), tuple(full.shape), (a,) + (0,) * (full.dim() - 1))


def test_a_reshard_to_many_more_ranks_keeps_the_sources_chunk_count_and_reads_exact_frames(
        tmp_path: Path) -> None:
    """8 -> 64 ranks of FSDP2's layout (a small GPT's shapes, uneven splits, tensors with fewer
    rows than ranks, Adam's replicated 0-d ``step``): a group of 8 consecutive target ranks writes
    each small tensor's boxes as one chunk framed at the ranks' boundaries, so the output has no
    more chunks than the source and its manifest is not larger than the source's (one chunk per
    rank and tensor before: 8x the chunks). Every one of the 64 ranks then loads bit-exact and
    reads exactly one frame per box it holds."""
    src, dest = str(tmp_path / "src"), str(tmp_path / "dst")
    g = torch.Generator().manual_seed(3)
    full = {"emb": torch.randn(130, 16, generator=g), "wq": torch.randn(64, 64, generator=g),
            "w1": torch.randn(100, 8, generator=g), "norm": torch.randn(7, generator=g),
            "bias": torch.randn(3, 4, generator=g)}

    def state(rank: int, world: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"model": {n: _fsdp2(t, rank, world) for n, t in tensors.items()},
                "optim": {n: {"exp_avg": _fsdp2(2 * t, rank, world),
                              "step": torch.tensor(7.0)} for n, t in tensors.items()}}

    saving = [ckptd.Checkpointer(src, rank=r, world_size=8, run_id="src") for r in range(8)]
    for h in [c.save_async(state(r, 8, full), step=7) for r, c in enumerate(saving)]:
        h.result()
    for c in saving:
        c.close()
    assert main(["reshard", src, "--to-world", "64", "--out", dest, "--threads", "2"]) == 0

    def manifest(root: str) -> tuple[int, int]:
        raw = open_storage(root).read_bytes(L.manifest_path(7))
        m = decode(raw, root)
        return sum(len(e.chunks) for e in m.tensors.values()), len(raw)

    (src_chunks, src_bytes), (out_chunks, out_bytes) = manifest(src), manifest(dest)
    assert out_chunks <= src_chunks, (out_chunks, src_chunks)
    assert out_bytes <= src_bytes, (out_bytes, src_bytes)
    zeros = {n: torch.zeros_like(t) for n, t in full.items()}
    for rank in range(64):
        dst = state(rank, 64, zeros)
        with ckptd.Checkpointer(dest, rank=rank, world_size=64, run_id="load") as ck:
            ck.load(dst)
        want = state(rank, 64, full)
        pairs = [(f"model/{n}", dst["model"][n], want["model"][n]) for n in full]
        pairs += [(f"optim/{n}", dst["optim"][n]["exp_avg"], want["optim"][n]["exp_avg"])
                  for n in full]
        for name, got, exp in pairs:
            assert torch.equal(got.local, exp.local), (rank, name)
        assert all(dst["optim"][n]["step"].item() == 7.0 for n in full)
        boxes = sum(got.local.numel() > 0 for _, got, _ in pairs)
        stats = last_stats()
        assert stats is not None
        # one frame per box held (the steps: one frame each, written once by their first holder)
        assert stats.reads.frames == boxes + len(full), (rank, stats.reads.frames, boxes)


@pytest.mark.parametrize("layout", ["dim0", "flat"])
def test_coalesced_boxes_tile_the_ranks_boxes_and_frame_them_at_their_boundaries(
        layout: str) -> None:
    """The coalescing rule on its own, 64 ranks in groups of 8: FSDP2's dim-0 shards (uneven,
    some ranks with none) and ZeRO-3's flat slices (one flat buffer over every tensor, cut evenly:
    slices start mid-row and do not line up with the rows). The merged boxes of a group cover
    exactly its ranks' boxes, once; each rank's box lies in one merged box; frames start at every
    rank boundary where that keeps at most 4 frames per rank (dim 0: exactly one frame per box),
    else a rank's box spans at most one frame more than it needs."""
    import math

    from ckptd.elastic.writers import coalesce
    from ckptd.loader.targets import Target
    from ckptd.regions import Box, flat_to_boxes

    world, group = 64, 8
    shapes = {"emb": (130, 16), "wq": (64, 64), "norm": (7,), "bias": (3, 4), "w1": (100, 8)}
    ranks: list[list[Target]] = [[] for _ in range(world)]
    if layout == "dim0":
        for n, s in shapes.items():
            per = -(-s[0] // world)
            for r in range(world):
                a, b = min(s[0], r * per), min(s[0], (r + 1) * per)
                if b > a:
                    ranks[r].append(Target(n, s, "float32", Box((a,) + (0,) * (len(s) - 1),
                                                                 (b - a, *s[1:]))))
    else:
        starts = dict(zip(shapes, [0, *itertools.accumulate(math.prod(s) for s in shapes.values())],
                          strict=False))
        total = sum(math.prod(s) for s in shapes.values())
        share = -(-total // world)
        for r in range(world):
            lo, hi = r * share, min(total, (r + 1) * share)
            for n, s in shapes.items():
                a, b = max(lo, starts[n]), min(hi, starts[n] + math.prod(s))
                if b > a:
                    ranks[r] += [Target(n, s, "float32", bx)
                                 for bx in flat_to_boxes(s, a - starts[n], b - starts[n])]
    target = [t for held in ranks for t in held]
    holders = [[r] for r, held in enumerate(ranks) for _ in held]
    coalesce(target, holders, group, below=1 << 20, most=16 << 20)
    written = [(t, rs[0]) for t, rs in zip(target, holders, strict=True) if rs]
    merged = [(t, w) for t, w in written if t.frame_bytes]
    assert len(merged) < len(target) // 4, "most boxes merged"
    for n, s in shapes.items():  # every element written once
        cover = torch.zeros(s, dtype=torch.int32)
        for t, _ in written:
            if t.name == n:
                cover[t.box.within(Box.whole(s))] += 1
        assert bool((cover == 1).all()), n
    for m, _ in merged:  # no tiny frames: at most 4 per box merged into it, and 4 more
        inside = sum(1 for t in (t for held in ranks for t in held)
                     if t.name == m.name and m.box.contains(t.box))
        assert -(-m.box.numel * 4 // m.frame_bytes) <= 4 * (inside + 1), (m, inside)
    for r, held in enumerate(ranks):
        for t in held:
            outer = [m for m, w in merged if m.name == t.name and m.box.contains(t.box)]
            if not outer:  # not merged: written by its rank as it is
                assert (t, r) in written
                continue
            assert len(outer) == 1 and outer[0].box.contains(t.box)
            m = outer[0]
            assert r // group == next(w for mm, w in merged if mm is m) // group
            # frames of m (in elements, row-major in m) that t's elements touch
            fe = m.frame_bytes // 4
            first = _flat_in(m.box, t.box.offsets)
            last = first + t.box.numel - 1
            frames = last // fe - first // fe + 1
            need = -(-t.box.numel // fe)
            if layout == "dim0":
                assert (first % fe, frames) == (0, 1), (r, t)
            else:
                assert frames <= need + 1, (r, t, frames, need)


def _flat_in(box, offsets) -> int:
    """The row-major index, within ``box``, of the element at global ``offsets``."""
    i = 0
    for o, a, n in zip(offsets, box.offsets, box.sizes, strict=True):
        i = i * n + (o - a)
    return i
