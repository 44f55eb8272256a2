"""Save under every parallel layout, load under every layout: bit-exact, padding untouched.

Each layout of ``transformer_state.LAYOUTS`` is saved once (one multi-process run into its own
root); then, per target layout, one multi-process run loads every saved checkpoint in turn into
a destination filled with NaN and compares it with the single-process reference. A failure names
the source -> target pair and the logical tensors (or padding buffers) that differ.
"""

from __future__ import annotations

import math
import struct
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multirank
import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (imported once here rather than in every rank)
import transformer_state as ts
from transformer_state import LAYOUTS, Layout, RankState, build_state

import ckptd
import ckptd.config
from ckptd.regions import Box
from ckptd.sharding import LOCAL_PREFIX, Local, describe, local_name

LAYOUT_NAMES = list(LAYOUTS)
# Loading targets of the default run: one of each kind of destination (plain, flat ZeRO-3
# buffers, flat buffers under TP with partial overlaps, column-major TP, TP x PP x ZeRO-3,
# DTensor); every source is loaded into each. The other targets are `slow` (.ci/run runs them).
DEFAULT_TARGETS = {"single", "dp2_zero3", "tp2_dp2_zero1", "dp2_tp2_col_major",
                   "tp2_pp2_dp2_zero3", "dtensor_dp3"}
TARGETS = [pytest.param(n, marks=() if n in DEFAULT_TARGETS else pytest.mark.slow)
           for n in LAYOUT_NAMES]
RUN_TIMEOUT_S = 150.0  # one multi-process run (a save, or a target loading every checkpoint)
PG_TIMEOUT_S = 30.0  # one collective: a rank that failed mid-load stalls the others this long
MAX_REPORTED = 40  # problem lines shown per failing test


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mask of elements whose bits differ (float32 tensors of one shape)."""
    return a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)


def region(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[box.within(Box.whole(tuple(t.shape)))]


# --- the layouts themselves: pieces of all ranks reassemble the reference --------------------


@dataclass
class PieceRecord:
    rank: int
    name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    box: Box
    values: torch.Tensor
    replica: int
    replicas: int
    is_writer: bool


def rank_pieces(layout: Layout, rank: int, world: int) -> list[PieceRecord]:
    st = build_state(layout, rank, ts.reference())
    return [
        PieceRecord(
            rank,
            p.name,
            p.global_shape,
            p.dtype,
            p.box,
            p.view.clone(),
            p.replica,
            p.replicas,
            p.is_writer,
        )
        for p in describe(st.state, rank, world).pieces
    ]


def _rank_pieces_worker(rank: int, world: int, layout_name: str) -> list[PieceRecord]:
    return rank_pieces(LAYOUTS[layout_name], rank, world)


def reassembly_problems(layout: Layout, pieces: list[PieceRecord]) -> list[str]:
    """Every logical tensor is covered by written pieces that hold the reference's values; copies
    marked as replicas of one another number their replicas 0..n-1 and elect one writer."""
    ref = ts.reference()
    problems = []
    tensors = [p for p in pieces if not p.name.startswith(LOCAL_PREFIX + "/")]
    names = {p.name for p in tensors}
    if names != set(ref):
        problems.append(
            f"logical tensors differ: missing {sorted(set(ref) - names)}, "
            f"unexpected {sorted(names - set(ref))}"
        )
    covered = {n: torch.zeros(t.shape, dtype=torch.bool) for n, t in ref.items()}
    for p in tensors:
        if p.name not in ref:
            continue
        want = ref[p.name]
        if p.global_shape != tuple(want.shape) or p.dtype != want.dtype:
            problems.append(f"{p.name} (rank {p.rank}): global shape {p.global_shape} {p.dtype}")
            continue
        if not same_bits(p.values, region(want, p.box)):
            problems.append(f"{p.name} (rank {p.rank}): box {p.box} does not hold the reference")
        if p.is_writer:
            region(covered[p.name], p.box).fill_(True)
    for name, mask in covered.items():
        if not bool(mask.all()):
            problems.append(f"{name}: {int((~mask).sum())} elements written by no rank")
    copies: dict[tuple[str, Box], list[PieceRecord]] = defaultdict(list)
    for p in tensors:
        copies[(p.name, p.box)].append(p)
    for (name, box), group in copies.items():
        declared = [p for p in group if p.replicas > 1]
        if not declared:
            continue
        replicas = {p.replicas for p in group}
        indices = sorted(p.replica for p in group)
        writers = sum(p.is_writer for p in group)
        if replicas != {len(group)} or indices != list(range(len(group))) or writers != 1:
            problems.append(
                f"{name} {box}: {len(group)} copies declare replicas {sorted(replicas)}, "
                f"indices {indices}, {writers} writers (want 1)"
            )
    for rank in range(layout.world_size):
        if not any(p.name == local_name(rank, "rng") for p in pieces):
            problems.append(f"rank {rank}: its Local rng state is not a piece")
    return problems


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
def test_layout_pieces_reassemble_reference(layout_name: str) -> None:
    layout = LAYOUTS[layout_name]
    n = layout.world_size
    if layout.dtensor:
        per_rank = multirank.run(_rank_pieces_worker, n, layout_name, timeout=RUN_TIMEOUT_S)
    else:
        per_rank = [rank_pieces(layout, r, n) for r in range(n)]
    problems = reassembly_problems(layout, [p for ps in per_rank for p in ps])
    assert problems == [], f"{layout_name}:\n" + "\n".join(problems[:MAX_REPORTED])


@pytest.mark.parametrize("layout_name", [n for n, lay in LAYOUTS.items() if lay.zero])
def test_zero_layouts_pad_the_flat_buffer_tail_and_padding_yields_no_piece(
    layout_name: str,
) -> None:
    layout = LAYOUTS[layout_name]
    ref = ts.reference()
    padded = 0
    for rank in range(layout.world_size):
        st = build_state(layout, rank, ref)
        pieces = describe(st.state, rank, layout.world_size).pieces
        for path, buf in st.buffers.items():
            if not path.rsplit("/", 1)[-1].startswith("flat"):
                continue
            pad = buf == ts.SOURCE_PADDING
            padded += int(pad.sum())
            # padding is a suffix of the buffer, and no piece views it
            assert bool(pad[int((~pad).sum()) :].all()), f"{path}: padding is not at the tail"
            views = [
                p.view
                for p in pieces
                if p.view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            ]
            seen = sum(v.numel() for v in views)
            assert seen == int((~pad).sum()), f"{path}: pieces view {seen} of the data elements"
    assert padded > 0, f"{layout_name}: no flat buffer has tail padding"


def test_dp3_zero1_splits_a_buffer_whose_length_is_not_divisible_by_three() -> None:
    layout = LAYOUTS["dp3_zero1"]
    data = sum(math.prod(p.shape) for p in ts.PARAMS)
    assert data % 3 != 0
    shards = [
        build_state(layout, r, ts.reference()).buffers["optim/exp_avg/flat"] for r in range(3)
    ]
    assert len({s.numel() for s in shards}) == 1, "DP shards of one buffer have equal lengths"
    assert sum(int((s != ts.SOURCE_PADDING).sum()) for s in shards) == data


def test_tp_zero_buffers_cut_replicated_norms_at_different_places() -> None:
    """tp2_dp2_zero1: the norm regions held by the ranks overlap only partially."""
    layout = LAYOUTS["tp2_dp2_zero1"]
    name = "optim/exp_avg/layers.1.attn_norm.weight"
    boxes = set()
    for rank in range(layout.world_size):
        st = build_state(layout, rank, ts.reference())
        for p in describe(st.state, rank, layout.world_size).pieces:
            if p.name == name:
                boxes.add(p.box)
    full = Box.whole((ts.HIDDEN,))
    partial = {b for b in boxes if b != full}
    assert len(partial) >= 2, f"{name}: boxes {sorted(boxes, key=str)}"
    assert any(a.intersect(b) not in (None, a, b) for a in boxes for b in boxes), sorted(
        boxes, key=str
    )


def test_col_major_layout_holds_non_contiguous_leaves() -> None:
    st = build_state(LAYOUTS["dp2_tp2_col_major"], 3, ts.reference())
    model = st.state["model"]
    assert not model["layers.0.attn.o.weight"].local.is_contiguous()
    assert not model["layers.1.mlp.gate_up.weight"].local.is_contiguous()


# --- save under every layout, load under every layout --------------------------------------


# Settings varied across the matrix, so that every layout pair also runs through compressed and
# multi-frame chunks (partial frame reads) and through the two-pass load that a small load budget
# forces. Each is (Checkpointer keyword arguments, ckptd.config tunables).
SAVE_SETTINGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dp2_zero3": ({"compression": "zstd"}, {"frame_bytes": 256}),
    "tp2_dp2_zero1": ({}, {"frame_bytes": 200}),
    "dtensor_dp2_tp2": ({"compression": "zstd:3"}, {}),
    "tp2_dp3_zero3": ({}, {"frame_bytes": 64}),
}
LOAD_SETTINGS: dict[str, dict[str, Any]] = {
    "dp3_zero1": {"load_budget_bytes": 1024},
    "tp2_pp2_dp2_zero3": {"load_budget_bytes": 4096},
    "dtensor_dp3": {"load_budget_bytes": 1},
}


def pair(source: str, target: str) -> str:
    """``source -> target``, with the non-default settings of each side."""
    saved = {k: v for d in SAVE_SETTINGS.get(source, ({}, {})) for k, v in d.items()}
    loaded = LOAD_SETTINGS.get(target, {})
    return f"{source}{f' {saved}' if saved else ''} -> {target}{f' {loaded}' if loaded else ''}"


def _save_worker(rank: int, world: int, layout_name: str, root: str) -> list[str]:
    layout = LAYOUTS[layout_name]
    kwargs, tunables = SAVE_SETTINGS.get(layout_name, ({}, {}))
    ref = ts.reference()
    src = build_state(layout, rank, ref)
    with ckptd.config.override(**tunables):
        ck = ckptd.Checkpointer(root, rank=rank, world_size=world, **kwargs)
        try:
            result = ck.save(src.state, step=ts.STEP)
        finally:
            ck.close()
    problems = []
    if result.step != ts.STEP:
        problems.append(f"rank {rank}: SaveResult.step {result.step}, want {ts.STEP}")
    untouched = build_state(layout, rank, ref)
    for path, buf in src.buffers.items():
        if not same_bits(buf, untouched.buffers[path]):
            problems.append(f"rank {rank}: save modified {path}")
    return problems


def padding_bytes_in(root: Path) -> list[str]:
    """Files under ``root`` holding the float32 padding value: padding must never be saved."""
    needle = struct.pack("<f", ts.SOURCE_PADDING)
    return [
        str(f.relative_to(root))
        for f in sorted(root.rglob("*"))
        if f.is_file() and needle in f.read_bytes()
    ]


def load_problems(
    source: str, layout: Layout, rank: int, dst: RankState, expected: RankState, result: Any
) -> list[str]:
    """What differs after loading ``source``'s checkpoint into rank ``rank``'s ``dst``."""
    ref = ts.reference()
    src_world = LAYOUTS[source].world_size
    out = []
    wrong: dict[str, int] = defaultdict(int)
    for p in describe(dst.state, rank, layout.world_size).pieces:
        if not p.name.startswith(LOCAL_PREFIX + "/") and not same_bits(
            p.view, region(ref[p.name], p.box)
        ):
            wrong[p.name] += int(differing(p.view, region(ref[p.name], p.box)).sum())
    for name, n in sorted(wrong.items()):
        out.append(f"{name}: {n} elements differ from the reference")
    for path, buf in dst.buffers.items():
        if path == "rng":
            continue
        want = expected.buffers[path]
        pad = torch.isnan(want)
        touched = int((differing(buf, want) & pad).sum())
        if touched:
            out.append(f"{path}: {touched} of {int(pad.sum())} padding elements overwritten")
    rng_want = ts.rng_state(rank) if rank < src_world else torch.zeros_like(ts.rng_state(rank))
    if not same_bits(dst.buffers["rng"], rng_want):
        out.append(
            f"Local rng: not what rank {rank} saved"
            if rank < src_world
            else "Local rng: changed although the saved world had no such rank"
        )
    data = dst.state["data"]
    data = data.value if isinstance(data, Local) else data
    data_want = ts.data_position(rank) if rank < src_world else ts.BLANK_DATA_POSITION
    if data != data_want:
        out.append(f"Local data: {data!r}, want {data_want!r}")
    values = {
        "step": (dst.state.get("step"), ts.STEP),
        "optim/step": (dst.state["optim"].get("step"), ts.OPTIM_STEP),
        "meta": (dst.state.get("meta"), {"layout": source, "lr": 3e-4}),
        "LoadResult.step": (getattr(result, "step", ts.STEP), ts.STEP),
    }
    for key, (got, want) in values.items():
        if got != want:
            out.append(f"{key}: {got!r}, want {want!r}")
    return [f"rank {rank}: {line}" for line in out]


def _load_worker(
    rank: int, world: int, target: str, sources: list[tuple[str, str]]
) -> tuple[dict[str, list[str]], str | None]:
    """Load each ``(source layout, root)`` in turn; stop after the first that raised anywhere
    (the ranks may then disagree about which collective comes next)."""
    layout = LAYOUTS[target]
    expected = build_state(layout, rank, ts.reference(), padding=ts.SENTINEL)
    out: dict[str, list[str]] = {}
    for source, root in sources:
        dst = build_state(layout, rank, None)
        try:
            tunables = LOAD_SETTINGS.get(target, {})
            with (
                ckptd.config.override(**tunables),
                ckptd.Checkpointer(root, rank=rank, world_size=world) as ck,
            ):
                result = ck.load(dst.state, strict=True)
            out[source] = load_problems(source, layout, rank, dst, expected, result)
            status = "ok"
        except Exception:
            out[source] = [f"rank {rank}: load raised\n{traceback.format_exc()}"]
            status = "raised"
        if "raised" in multirank.exchange(f"{target}/{source}", status):
            return out, source
    return out, None


class Saves:
    """Each layout saved once per module, on first use, into its own root."""

    def __init__(self, base: Path):
        self.base = base
        self.done: dict[str, tuple[str, list[str]]] = {}

    def get(self, name: str) -> tuple[str, list[str]]:
        """``(root, problems)``; no problems means a committed, faithful save."""
        if name not in self.done:
            root = str(self.base / name)
            try:
                per_rank = multirank.run(
                    _save_worker,
                    LAYOUTS[name].world_size,
                    name,
                    root,
                    timeout=RUN_TIMEOUT_S,
                    pg_timeout=PG_TIMEOUT_S,
                )
                problems = [line for lines in per_rank for line in lines]
                if not SAVE_SETTINGS.get(name, ({}, {}))[0].get("compression"):
                    problems += [f"padding saved in {f}" for f in padding_bytes_in(Path(root))]
            except multirank.RankFailed as e:
                problems = [f"save raised: {e}"]
            self.done[name] = (root, problems)
        return self.done[name]


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Saves:
    return Saves(tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
def test_save_commits_and_leaves_the_state_untouched(layout_name: str, saves: Saves) -> None:
    _, problems = saves.get(layout_name)
    assert problems == [], f"{layout_name}:\n" + "\n".join(problems[:MAX_REPORTED])


@pytest.mark.parametrize("target", TARGETS)
def test_every_saved_layout_loads_bit_exact_with_padding_untouched_into(
    target: str, saves: Saves
) -> None:
    problems: list[str] = []
    remaining = []
    for source in LAYOUT_NAMES:
        root, save_problems = saves.get(source)
        if save_problems:
            problems.append(f"{pair(source, target)}: not checked, the save failed")
        else:
            remaining.append((source, root))
    while remaining:
        try:
            per_rank = multirank.run(
                _load_worker,
                LAYOUTS[target].world_size,
                target,
                remaining,
                timeout=RUN_TIMEOUT_S,
                pg_timeout=PG_TIMEOUT_S,
            )
        except multirank.RankFailed as e:  # a crash or a hang: blame the first unchecked source
            problems.append(f"{pair(remaining[0][0], target)}: {e}")
            remaining = remaining[1:]
            continue
        by_source: dict[str, list[str]] = defaultdict(list)
        for results, _ in per_rank:
            for source, lines in results.items():
                by_source[source] += lines
        for source, lines in by_source.items():
            problems += [f"{pair(source, target)}: {line}" for line in lines]
        stopped = per_rank[0][1]
        done = [s for s, _ in remaining].index(stopped) + 1 if stopped else len(remaining)
        remaining = remaining[done:]
    assert problems == [], f"{len(problems)} problems:\n" + "\n".join(problems[:MAX_REPORTED])


# --- the harness itself ------------------------------------------------------------------------


def _fail_on_rank_one(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()
    return rank


def _hang_on_rank_zero(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        dist.barrier()  # never matched: rank 0 waits on the store below
    multirank.store().wait(["never-set"])
    return rank


def _die_on_rank_one(rank: int, world: int) -> int:
    import os

    # rank 0 returns once rank 1 is past the process group's start: returning (and destroying
    # the group) earlier could fail rank 1 inside init_process_group instead (seen under load)
    if rank == 1:
        multirank.store().set("dying", "1")
        os._exit(3)
    multirank.store().wait(["dying"])
    return rank


def _sum_ranks(rank: int, world: int, base: int) -> tuple[int, list[str]]:
    import torch.distributed as dist

    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return int(t.item()), multirank.exchange("who", str(rank))


def test_harness_returns_each_ranks_value_after_a_gloo_all_reduce() -> None:
    got = multirank.run(_sum_ranks, 4, 10, timeout=60)
    assert got == [(46, ["0", "1", "2", "3"])] * 4


def test_harness_raises_with_the_failing_ranks_traceback() -> None:
    with pytest.raises(multirank.RankFailed) as info:
        multirank.run(_fail_on_rank_one, 3, timeout=60, pg_timeout=10)
    assert 1 in info.value.failures
    assert "ValueError: rank one refuses" in info.value.failures[1]
    assert "ValueError: rank one refuses" in str(info.value)


def test_harness_kills_ranks_that_outlive_the_timeout() -> None:
    with pytest.raises(multirank.RankFailed) as info:
        multirank.run(_hang_on_rank_zero, 2, timeout=1)
    assert "timed out after 1s; ranks still running: [0, 1]" in str(info.value)


def test_harness_reports_a_rank_that_died_without_a_traceback() -> None:
    with pytest.raises(multirank.RankFailed) as info:
        multirank.run(_die_on_rank_one, 2, timeout=60)
    assert info.value.failures == {1: "rank 1 died without reporting (exit code 3)"}
