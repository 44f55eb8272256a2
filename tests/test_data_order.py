"""The global sample order (``ckptd.data``): permutations that are permutations, a stream that
any sequence of world sizes and batch re-plans reads exactly once, and a resume that refuses a
changed dataset by name.

The elastic restarts here are real ``elastic.resume`` calls on a real checkpoint root (one
process playing data-parallel rank 0; the other ranks' micro-batches come from samplers built
with their ranks, as each of them would build it).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

import ckptd
from ckptd import elastic
from ckptd.data import (
    DataMismatch,
    GlobalBatchSampler,
    GlobalOrder,
    ShardedOrder,
    StreamOrder,
)
from ckptd.data.permutation import ALGORITHMS, LEGACY, Feistel, permutation, round_keys

examples = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@examples
@given(st.integers(1, 5000), st.integers(0, 2**64 - 1), st.integers(0, 50),
       st.sampled_from(ALGORITHMS))
def test_a_permutation_is_a_bijection_of_its_range(n: int, seed: int, epoch: int,
                                                   algorithm: str) -> None:
    p = permutation(n, (seed, epoch), algorithm=algorithm)
    assert sorted(p(i) for i in range(n)) == list(range(n))
    with pytest.raises(IndexError):
        p(n)


@examples
@given(st.integers(2, 3000), st.integers(0, 2**64 - 1))
def test_the_computed_permutation_is_a_bijection_at_every_size(n: int, seed: int) -> None:
    """The Feistel network serves 4096 elements and more; its arithmetic holds at any size."""
    p = Feistel(n, round_keys((seed,), 8))
    assert sorted(p(i) for i in range(n)) == list(range(n))


def test_orders_depend_on_seed_and_epoch_and_not_on_anything_else() -> None:
    a, b = GlobalOrder(1000, seed=1), GlobalOrder(1000, seed=2)
    first = [a.index(p) for p in range(1000)]
    assert first == [GlobalOrder(1000, seed=1).index(p) for p in range(1000)]  # reproducible
    assert first != [b.index(p) for p in range(1000)]
    assert first != [a.index(p) for p in range(1000, 2000)]  # the next epoch is reshuffled
    assert [GlobalOrder(10, shuffle=False).index(p) for p in range(12)] == [*range(10), 0, 1]
    # fixed values: the order is part of the format (a change here breaks every resume), an
    # exact shuffle below 4096 samples and a computed one above; and the legacy algorithm's
    # orders are those of the ckptd versions that had it
    assert [GlobalOrder(10, seed=3).index(p) for p in range(10)] == [0, 8, 7, 9, 6, 4, 1, 2, 3, 5]
    assert [GlobalOrder(5000, seed=11).index(p) for p in (0, 1, 2, 4999, 5000, 12345)] == \
        [1356, 4176, 98, 4859, 3019, 1324]
    assert [GlobalOrder(10, seed=3, algorithm=LEGACY).index(p) for p in range(10)] == \
        [6, 1, 4, 3, 8, 0, 5, 2, 7, 9]
    assert [GlobalOrder(5000, seed=11, algorithm=LEGACY).index(p)
            for p in (0, 1, 2, 4999, 5000, 12345)] == [1020, 3177, 4335, 4080, 2813, 2618]
    sharded = ShardedOrder([3, 0, 5, 2], seed=4)
    assert [sharded.index(p) for p in range(10)] == [
        (2, 4), (0, 1), (2, 0), (2, 1), (0, 0), (3, 1), (2, 2), (0, 2), (2, 3), (3, 0)]
    legacy = ShardedOrder([3, 0, 5, 2], seed=4, algorithm=LEGACY)
    assert [legacy.index(p) for p in range(10)] == [
        (3, 0), (3, 1), (0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]
    assert legacy.spec()["shard_lengths"] == "7e42df7fa2e3a2d3"


@examples
@given(st.lists(st.integers(0, 7), min_size=1, max_size=40).filter(lambda xs: sum(xs) > 0),
       st.integers(0, 1000), st.integers(1, 6))
def test_a_sharded_order_reads_every_record_once_per_epoch_a_few_shards_at_a_time(
        lengths: list[int], seed: int, block: int) -> None:
    order = ShardedOrder(lengths, seed=seed, block_shards=block)
    total = sum(lengths)
    for epoch in range(2):
        got = [order.index(p) for p in range(epoch * total, (epoch + 1) * total)]
        assert sorted(got) == [(s, o) for s, n in enumerate(lengths) for o in range(n)]
        # every shard's records lie in one stretch of the epoch where at most `block` shards
        # are read: a reader holds a few shards at a time
        span = {s: (min(i for i, (t, _) in enumerate(got) if t == s),
                    max(i for i, (t, _) in enumerate(got) if t == s)) for s, _ in got}
        for lo, hi in span.values():
            assert len({s for s, _ in got[lo:hi + 1]}) <= block


@examples
@given(st.lists(st.integers(0, 7), min_size=1, max_size=12).filter(lambda xs: sum(xs) > 0),
       st.sampled_from(ALGORITHMS))
def test_an_unshuffled_sharded_order_reads_the_shards_as_listed(lengths: list[int],
                                                                algorithm: str) -> None:
    order = ShardedOrder(lengths, shuffle=False, algorithm=algorithm)
    records = [(s, o) for s, n in enumerate(lengths) for o in range(n)]
    assert [order.index(p) for p in range(2 * len(records))] == records * 2


class _Positions:
    """An order whose samples are the stream positions themselves (what the property checks)."""

    length = 1 << 60

    def index(self, position: int) -> int:
        return position

    def epoch(self, position: int) -> int:
        return 0

    def spec(self) -> dict[str, Any]:
        return {"kind": "positions"}


phases = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3),
                            st.integers(0, 4)), min_size=1, max_size=6)


@examples
@given(phases, st.integers(1, 40), st.integers(0, 9))
def test_any_sequence_of_worlds_and_replans_reads_the_stream_exactly_once(
        plan: list[tuple[int, int, int, int]], length: int, seed: int) -> None:
    """Phases of (dp size, micro-batch, accumulation, steps) each resuming from the position the
    previous one saved: all ranks together read a prefix of the stream, each position once, and
    the samples of every complete epoch are the dataset, once each."""
    consumed, read = 0, []
    for dp, micro, accum, steps in plan:
        for rank in range(dp):
            s = GlobalBatchSampler(_Positions(), consumed=consumed, dp_rank=rank, dp_size=dp,
                                   micro_batch=micro, grad_accum=accum, steps=steps)
            assert len(s) == steps * accum
            read += [p for batch in s for p in batch]
        consumed += steps * dp * micro * accum  # what step_done counts
    assert sorted(read) == list(range(consumed))
    order = GlobalOrder(length, seed=seed)
    samples = [order.index(p) for p in sorted(read)]
    for e in range(consumed // length):
        assert sorted(samples[e * length : (e + 1) * length]) == list(range(length))


# --------------------------------------------------------------------------- with resume()

MODEL = elastic.ModelSpec(hidden_size=32, num_hidden_layers=2, num_parameters=20_000)
REFERENCE = elastic.TrainingSpec(zero_stage=1, world_size=3, micro_batch_size=2,
                                 gradient_accumulation_steps=2, sequence_length=16)
POLICY = elastic.ElasticPolicy(tolerance=0.0, mem_limit_gib=1.0, max_micro_batch_size=4)


class Tokens(Dataset[torch.Tensor]):
    """A small tokenised corpus: sample ``i`` is 8 tokens of a fixed text."""

    def __init__(self, n: int) -> None:
        text = ("the quick brown fox jumps over the lazy dog " * 64).split()
        vocab = {w: i for i, w in enumerate(sorted(set(text)))}
        ids = torch.tensor([vocab[w] for w in text])
        self.rows = torch.stack([ids.roll(-i)[:8] for i in range(n)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.cat([torch.tensor([i]), self.rows[i]])  # the index rides along, to check


def _resume(root: Path, world: int, rank: int) -> elastic.ElasticRun:
    # rank 0 saves (a new job incarnation: a new run id); the others only read
    ckpt = ckptd.Checkpointer(str(root), rank=0, world_size=1, run_id=uuid.uuid4().hex[:12],
                              read_only=rank > 0)
    return elastic.resume(ckpt, reference=REFERENCE, model=MODEL, policy=POLICY,
                          world_size=world, dp_rank=rank)


def _phase(root: Path, world: int, steps: int, data: Dataset[torch.Tensor],
           order: GlobalOrder | ShardedOrder, **kw: Any) -> list[int]:
    """``steps`` optimizer steps on ``world`` data-parallel ranks (each a resume of the same
    checkpoint, as each rank of a restarted job is), then rank 0 saves. The indices read."""
    read: list[int] = []
    runs = [_resume(root, world, r) for r in range(world)]
    try:
        for run in runs:
            loader = DataLoader(data, batch_sampler=run.batch_sampler(order, steps=steps, **kw))
            read += [int(i) for batch in loader for i in batch[:, 0]]
        for _ in range(steps):
            for run in runs:
                run.step_done()
        runs[0].save({"step": runs[0].step})
    finally:
        for run in runs:
            run.close()
            run.ckpt.close()
    return read


def test_a_dataloader_resumed_at_3_then_2_then_3_ranks_reads_each_sample_once(
        tmp_path: Path, clean_sigterm: None) -> None:
    data, order = Tokens(50), GlobalOrder(50, seed=7)
    read = (_phase(tmp_path, 3, 2, data, order) + _phase(tmp_path, 2, 3, data, order)
            + _phase(tmp_path, 3, 2, data, order))
    assert len(read) == 12 * 7  # global batch 12 kept by every re-plan, 7 steps
    # exactly the stream's first 84 positions: the first epoch's 50 samples once each, then 34
    # of the second epoch's order
    assert Counter(read) == Counter(order.index(p) for p in range(84))
    assert Counter(order.index(p) for p in range(50)) == Counter(range(50))
    history = ckptd.Checkpointer(str(tmp_path), read_only=True).read_manifest(7).training
    assert history["data"] == order.spec() and history["consumed_samples"] == 84


def test_a_resume_with_another_dataset_names_what_changed(
        tmp_path: Path, clean_sigterm: None) -> None:
    _phase(tmp_path, 3, 1, Tokens(50), GlobalOrder(50, seed=7))
    with pytest.raises(DataMismatch, match=r"length 50 -> 60.*allow_data_change"):
        _phase(tmp_path, 2, 1, Tokens(60), GlobalOrder(60, seed=7))
    with pytest.raises(DataMismatch, match=r"seed 7 -> 8"):
        _phase(tmp_path, 2, 1, Tokens(50), GlobalOrder(50, seed=8))
    read = _phase(tmp_path, 2, 1, Tokens(60), GlobalOrder(60, seed=7), allow_data_change=True)
    # the epoch in progress goes on under the order it started with
    assert Counter(read) == Counter(GlobalOrder(50, seed=7).index(p) for p in range(12, 24))


# --------------------------------------------------------------------------- data changes


def _reads(*parts: tuple[GlobalOrder | ShardedOrder, range]) -> Counter[Any]:
    return Counter(_key(order.index(p)) for order, positions in parts for p in positions)


def _key(index: Any) -> int:
    return index[0] * 1000 + index[1] if isinstance(index, tuple) else index


class Records(Dataset[torch.Tensor]):
    """Sharded records: ``(shard, offset)`` reads as ``shard * 1000 + offset``."""

    def __getitem__(self, at: tuple[int, int]) -> torch.Tensor:
        return torch.tensor([_key(at)])

    def __len__(self) -> int:
        raise TypeError("read through a batch sampler only")


def test_a_seed_change_mid_epoch_repeats_and_skips_nothing_in_that_epoch(
        tmp_path: Path, clean_sigterm: None) -> None:
    """Seed 7 -> 8 at position 72 of 97: the rest of epoch 0 is seed 7's, epoch 1 is seed 8's.
    (Continuing at position 72 of seed 8's order, as before, repeated 20 samples of epoch 0 and
    never reached 20 others.)"""
    old, new = GlobalOrder(97, seed=7), GlobalOrder(97, seed=8)
    first = _phase(tmp_path, 3, 6, Tokens(97), old)  # positions 0..71
    second = _phase(tmp_path, 2, 11, Tokens(97), new, allow_data_change=True)  # 72..203
    assert Counter(second) == _reads((old, range(72, 97)), (new, range(97, 204)))
    # epochs 0 and 1: every sample exactly once in each (and 10 positions of epoch 2)
    assert Counter(first) + Counter(second) == Counter({i: 2 for i in range(97)}) + _reads(
        (new, range(194, 204)))
    history = ckptd.Checkpointer(str(tmp_path), read_only=True).read_manifest(17).training
    meta = elastic.TrainingMeta.from_json(history)
    assert [meta.epoch(p) for p in (72, 96, 97, 193, 194)] == [0, 0, 1, 1, 2]


def test_more_samples_mid_epoch_start_with_the_next_epoch(
        tmp_path: Path, clean_sigterm: None) -> None:
    """97 -> 120 samples at position 72: the 97-sample epoch finishes, then the 120-sample
    order's epoch 1 (its own positions 120..239) follows from stream position 97."""
    old, new = GlobalOrder(97, seed=7), GlobalOrder(120, seed=7)
    _phase(tmp_path, 3, 6, Tokens(97), old)
    second = _phase(tmp_path, 2, 11, Tokens(120), new, allow_data_change=True)
    assert Counter(second) == _reads((old, range(72, 97)), (new, range(120, 227)))


def test_a_resume_while_an_epoch_finishes_keeps_finishing_it(
        tmp_path: Path, clean_sigterm: None) -> None:
    old, new = GlobalOrder(97, seed=7), GlobalOrder(97, seed=8)
    _phase(tmp_path, 3, 6, Tokens(97), old)
    _phase(tmp_path, 2, 1, Tokens(97), new, allow_data_change=True)  # 72..83
    third = _phase(tmp_path, 3, 3, Tokens(97), new)  # the saved order now: no flag
    assert Counter(third) == _reads((old, range(84, 97)), (new, range(97, 120)))
    with pytest.raises(DataMismatch, match="seed 8 -> 9"):  # a change is still a change
        _phase(tmp_path, 3, 1, Tokens(97), GlobalOrder(97, seed=9))


def test_a_change_at_an_epoch_boundary_takes_effect_at_once(
        tmp_path: Path, clean_sigterm: None) -> None:
    old, new = GlobalOrder(48, seed=7), GlobalOrder(48, seed=8)
    _phase(tmp_path, 3, 4, Tokens(48), old)  # exactly epoch 0
    second = _phase(tmp_path, 2, 2, Tokens(48), new, allow_data_change=True)
    assert Counter(second) == _reads((new, range(48, 72)))


def test_a_shrunk_dataset_mid_epoch_is_refused_with_what_now_would_skip(
        tmp_path: Path, clean_sigterm: None) -> None:
    old, new = GlobalOrder(97, seed=7), GlobalOrder(80, seed=7)
    _phase(tmp_path, 3, 6, Tokens(97), old)
    with pytest.raises(DataMismatch) as err:
        _phase(tmp_path, 2, 1, Tokens(80), new, allow_data_change=True)
    message = str(err.value)
    assert "length 97 -> 80" in message and "epoch 0 (stream position 72: 72 of its 97" in message
    assert "shrank from 97 to 80 samples" in message and "reads samples 80..96" in message
    assert "allow_data_change='now' starts epoch 1" in message
    assert "the 25 positions left of epoch 0 are not read" in message and "\n" not in message
    second = _phase(tmp_path, 2, 2, Tokens(80), new, allow_data_change="now")
    assert Counter(second) == _reads((new, range(80, 104)))  # epoch 1 of 80 from position 72
    with pytest.raises(ValueError, match="allow_data_change must be"):
        _phase(tmp_path, 2, 1, Tokens(80), new, allow_data_change="later")


def test_an_order_of_an_older_algorithm_finishes_its_epoch_then_upgrades(
        tmp_path: Path, clean_sigterm: None, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint of a ckptd whose orders were algorithm 1: no flag needed, the epoch in
    progress finishes under algorithm 1 (exactly once), algorithm 2 from the next; an order
    that asks for algorithm 1 keeps it."""
    v1, v2 = GlobalOrder(97, seed=7, algorithm=LEGACY), GlobalOrder(97, seed=7)
    _phase(tmp_path, 3, 6, Tokens(97), v1)
    assert Counter(_phase(tmp_path, 3, 1, Tokens(97), v1)) == _reads((v1, range(72, 84)))
    with caplog.at_level("WARNING", logger="ckptd.elastic"):
        second = _phase(tmp_path, 2, 10, Tokens(97), v2)
    assert Counter(second) == _reads((v1, range(84, 97)), (v2, range(97, 204)))
    assert "epoch 0 finishes with it, and epoch 1 on (from stream position 97)" in caplog.text


def test_a_sharded_order_finishes_its_epoch_when_shards_are_appended(
        tmp_path: Path, clean_sigterm: None) -> None:
    old, new = ShardedOrder([30] * 4, seed=1), ShardedOrder([30] * 6, seed=1)
    _phase(tmp_path, 3, 5, Records(), old)  # 60 of 120
    second = _phase(tmp_path, 2, 10, Records(), new, allow_data_change=True)  # 60..179
    assert Counter(second) == _reads((old, range(60, 120)), (new, range(180, 240)))
    with pytest.raises(DataMismatch, match=r"lengths of the first 6 shards changed.*'now'"):
        _phase(tmp_path, 2, 1, Records(), ShardedOrder([31, 29] + [30] * 4, seed=1),
               allow_data_change=True)


def test_a_stream_per_reader_refuses_a_resume_on_another_number_of_readers(
        tmp_path: Path, clean_sigterm: None) -> None:
    run = _resume(tmp_path, 3, 0)
    run.check_data(StreamOrder(readers=3 * 2))  # 3 ranks x 2 DataLoader workers
    run.step_done()
    run.save({"step": run.step})
    run.close()
    run.ckpt.close()
    again = _resume(tmp_path, 2, 0)
    try:
        with pytest.raises(DataMismatch, match=r"readers 6 -> 4"):
            again.check_data(StreamOrder(readers=2 * 2))
        again.check_data(StreamOrder(readers=6))  # the same readers: fine
        # a stream per reader is no order of ckptd's: an older ckptd's algorithm is no change
        again.meta = dataclasses.replace(again.meta, data={**StreamOrder(6).spec(),
                                                           "algorithm": LEGACY})
        again.check_data(StreamOrder(readers=6))
    finally:
        again.close()
        again.ckpt.close()


# --------------------------------------------------------------------------- a damaged position


def _reseal_training(root: Path, step: int, **changes: Any) -> None:
    """Change fields of a committed step's training metadata and seal the manifest again with a
    valid digest (the digest guards against damage; the validation against a bad value)."""
    from ckptd.manifest import layout
    from ckptd.manifest.encode import encode_doc
    from ckptd.manifest.parse import whole_doc

    path = root / layout.manifest_path(step)
    doc = whole_doc(path.read_bytes(), str(path))
    doc["training"].update(changes)
    path.write_bytes(encode_doc(doc))


@pytest.mark.parametrize("bad", [True, 24.9, "24", -8, 10**30, None])
def test_a_damaged_consumed_samples_is_refused_naming_the_field(
        tmp_path: Path, clean_sigterm: None, bad: Any) -> None:
    order = GlobalOrder(50, seed=7)
    _phase(tmp_path, 3, 2, Tokens(50), order)  # 2 steps of global batch 12: 24 consumed
    _reseal_training(tmp_path, 2, consumed_samples=bad)
    with pytest.raises(ckptd.CkptdError, match=r"consumed_samples") as err:
        _phase(tmp_path, 3, 1, Tokens(50), order)
    assert "\n" not in str(err.value) and repr(bad) in str(err.value)


@pytest.mark.parametrize("make, message", [
    (lambda: ShardedOrder([10.7, 5]), r"shard length .*10\.7"),
    (lambda: ShardedOrder([True, 5]), r"shard length .*True"),
    (lambda: ShardedOrder(["10", 5]), r"shard length .*'10'"),
    (lambda: ShardedOrder([-1, 5]), r"shard length .*-1"),
    (lambda: ShardedOrder([0, 0]), r"at least one record"),
    (lambda: ShardedOrder([2**62 - 1] * 5), r"fewer than 2\^62"),
    (lambda: GlobalOrder(True), r"length .*True"),
    (lambda: GlobalOrder(50.0), r"length .*50\.0"),
    (lambda: GlobalOrder(0), r"at least one sample.*got 0"),
    (lambda: GlobalOrder(1 << 62), r"length"),
    (lambda: GlobalOrder(10, seed=True), r"seed"),
])
def test_an_order_refuses_lengths_that_are_not_integers(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("bad, field", [
    ({"start": True}, "start"), ({"start": 10**30}, "start"), ({"start_epoch": -1}, "start_epoch"),
    ({"start": 30}, "after the 24 samples consumed"), ({"length": "97"}, "length"),
    ({"previous": 5}, "not an object"),
])
def test_a_damaged_data_record_is_refused_naming_the_field(
        tmp_path: Path, clean_sigterm: None, bad: dict[str, Any], field: str) -> None:
    order = GlobalOrder(50, seed=7)
    _phase(tmp_path, 3, 2, Tokens(50), order)
    _reseal_training(tmp_path, 2, data={**order.spec(), "previous": None, **bad})
    with pytest.raises(ckptd.CkptdError, match=field) as err:
        _phase(tmp_path, 3, 1, Tokens(50), order, allow_data_change=True)
    assert "\n" not in str(err.value)


def test_numpy_integers_are_lengths_and_seeds() -> None:
    import numpy as np

    assert GlobalOrder(np.int64(100), seed=np.uint32(3)).spec() == GlobalOrder(100, seed=3).spec()
    assert [GlobalOrder(np.int64(10)).index(p) for p in range(10)] == \
        [GlobalOrder(10).index(p) for p in range(10)]
    sharded = ShardedOrder(np.array([3, 0, 4]), seed=np.int64(1))
    assert sharded.spec() == ShardedOrder([3, 0, 4], seed=1).spec()
    assert isinstance(sharded.index(0)[0], int) and isinstance(sharded.index(0)[1], int)
