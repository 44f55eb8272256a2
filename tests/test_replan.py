"""Batch re-derivation: the memory model, the search and its tie-breaks, the table, the errors.

The property tests compare :func:`elastic.replan` with a brute-force search written here from the
contract (every micro-batch, every stage, every accumulation count); the table test checks rows
derived by hand for a 5B-class model.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ckptd.elastic import (
    InvalidSpec,
    ModelSpec,
    NoFeasiblePlan,
    Plan,
    TrainingSpec,
    estimate_memory,
    plan_table,
    replan,
)
from ckptd.elastic.search import batch_band
from ckptd.elastic.table import parse_world_range, render_json, render_markdown
from ckptd.errors import CkptdError

GIB = 2**30

# --------------------------------------------------------------------------- the brute force


def band_from_percent(global_batch: int, percent: int) -> tuple[int, int]:
    """[floor(B(1 - k/100)), ceil(B(1 + k/100))] in integer arithmetic."""
    lo = global_batch * (100 - percent) // 100
    hi = -(-global_batch * (100 + percent) // 100)
    return max(lo, 1), hi


def brute_force(
    model: ModelSpec,
    previous: TrainingSpec,
    world: int,
    percent: int,
    limit: float,
    max_micro: int,
    stages: tuple[int, ...],
    **memory: float,
) -> tuple[int, int, int] | None:
    """(zero, micro, accum) by the contract's literal search, or None.

    Order: micro-batch from max_micro down, stages in the given order, accumulation 1, 2, ...;
    keep a candidate only if it is strictly better by (|global - B|, zero stage), so that among
    equals the first found wins.
    """
    target = previous.global_batch_size
    lo, hi = band_from_percent(target, percent)
    best: tuple[tuple[int, int], tuple[int, int, int]] | None = None
    for micro in range(max_micro, 0, -1):
        for zero in stages:
            spec = TrainingSpec(zero, world, micro, 1, previous.sequence_length)
            if estimate_memory(model, spec, **memory).total_gib > limit:
                continue
            accum = 1
            while world * micro * accum <= hi:
                g = world * micro * accum
                if g >= lo:
                    key = (abs(g - target), zero)
                    if best is None or key < best[0]:
                        best = (key, (zero, micro, accum))
                accum += 1
    return None if best is None else best[1]


# --------------------------------------------------------------------------- strategies

memory_params = st.fixed_dictionaries(
    {
        "param_bytes": st.sampled_from([1, 2, 4]),
        "grad_bytes": st.sampled_from([2, 4]),
        "optim_bytes": st.sampled_from([2, 4]),
        "optim_slots": st.sampled_from([1, 2, 3]),
        "activation_constant": st.sampled_from([8, 16, 34]),
    }
)
models = st.builds(
    ModelSpec,
    hidden_size=st.integers(64, 8192),
    num_hidden_layers=st.integers(1, 64),
    num_parameters=st.integers(10**6, 2 * 10**10),
    dtype_bytes=st.sampled_from([1, 2, 4]),
)
previous_specs = st.builds(
    TrainingSpec,
    zero_stage=st.integers(0, 3),
    world_size=st.integers(1, 48),
    micro_batch_size=st.integers(1, 8),
    gradient_accumulation_steps=st.integers(1, 8),
    sequence_length=st.sampled_from([128, 1024, 4096]),
)
stage_orders = st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True).map(tuple)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    model = draw(models)
    previous = draw(previous_specs)
    memory = draw(memory_params)
    # A limit around what the previous run needed, so that both outcomes are common.
    needed = estimate_memory(model, previous, **memory).total_gib
    return {
        "model": model,
        "previous": previous,
        "world": draw(st.integers(1, 300)),
        "percent": draw(st.integers(0, 30)),
        "limit": needed * draw(st.floats(0.2, 3.0)),
        "max_micro": draw(st.integers(1, 40)),
        "stages": draw(stage_orders),
        "memory": memory,
    }


def run(case: dict[str, object], **overrides: object) -> Plan:
    args = {**case, **overrides}
    return replan(
        args["model"],  # type: ignore[arg-type]
        args["previous"],  # type: ignore[arg-type]
        args["world"],  # type: ignore[arg-type]
        tolerance=args.get("tolerance", args["percent"] / 100),  # type: ignore[operator]
        mem_limit_gib=args["limit"],  # type: ignore[arg-type]
        max_micro_batch_size=args["max_micro"],  # type: ignore[arg-type]
        zero_stages=args["stages"],  # type: ignore[arg-type]
        **args["memory"],  # type: ignore[arg-type]
    )


def reference(case: dict[str, object], **overrides: object) -> tuple[int, int, int] | None:
    a = {**case, **overrides}
    return brute_force(
        a["model"],  # type: ignore[arg-type]
        a["previous"],  # type: ignore[arg-type]
        a["world"],  # type: ignore[arg-type]
        a["percent"],  # type: ignore[arg-type]
        a["limit"],  # type: ignore[arg-type]
        a["max_micro"],  # type: ignore[arg-type]
        a["stages"],  # type: ignore[arg-type]
        **a["memory"],  # type: ignore[arg-type]
    )


PROPERTY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- properties


@PROPERTY
@given(cases())
def test_replan_returns_a_plan_inside_the_band_and_under_the_memory_limit(
    case: dict[str, object],
) -> None:
    try:
        plan = run(case)
    except NoFeasiblePlan:
        assume(False)
        return
    previous: TrainingSpec = case["previous"]  # type: ignore[assignment]
    lo, hi = band_from_percent(previous.global_batch_size, case["percent"])  # type: ignore[arg-type]
    t = plan.training
    assert lo <= t.global_batch_size <= hi
    assert plan.memory.total_gib <= case["limit"]  # type: ignore[operator]
    assert plan.memory == estimate_memory(case["model"], t, **case["memory"])  # type: ignore[arg-type]
    assert t.world_size == case["world"]
    assert t.sequence_length == previous.sequence_length
    assert 1 <= t.micro_batch_size <= case["max_micro"]  # type: ignore[operator]
    assert t.zero_stage in case["stages"]  # type: ignore[operator]
    b = previous.global_batch_size
    assert plan.deviation == (t.global_batch_size - b) / b


@PROPERTY
@given(cases())
def test_replan_agrees_with_the_brute_force_search_including_tie_breaks(
    case: dict[str, object],
) -> None:
    expected = reference(case)
    if expected is None:
        with pytest.raises(NoFeasiblePlan):
            run(case)
        return
    t = run(case).training
    got = (t.zero_stage, t.micro_batch_size, t.gradient_accumulation_steps)
    assert got == expected


@PROPERTY
@given(cases())
def test_no_feasible_plan_names_options_that_do_work(case: dict[str, object]) -> None:
    try:
        run(case)
    except NoFeasiblePlan as e:
        err = e
    else:
        assume(False)
        return
    world: int = case["world"]  # type: ignore[assignment]
    assert err.world_size == world
    assert f"world size {world} has no plan" in str(err)
    assert "\n" not in str(err)
    offered = [
        err.needed_tolerance,
        err.needed_mem_limit_gib,
        err.world_below,
        err.world_above,
    ]
    if err.needed_tolerance is not None:
        assert err.needed_tolerance > case["percent"] / 100  # type: ignore[operator]
        # replan itself rather than the brute force: the tolerance is not a whole percent.
        run(case, tolerance=err.needed_tolerance)
    if err.needed_mem_limit_gib is not None:
        assert err.needed_mem_limit_gib > case["limit"]  # type: ignore[operator]
        assert reference(case, limit=err.needed_mem_limit_gib) is not None
        # ... and it is the least limit that works: just below it there is still no plan.
        assert reference(case, limit=err.needed_mem_limit_gib * (1 - 1e-9)) is None
    if err.world_below is not None:
        assert "ranks idle" in str(err)
        assert reference(case, world=err.world_below) is not None
        for w in range(err.world_below + 1, world):
            assert reference(case, world=w) is None, w
    if err.world_above is not None:
        assert reference(case, world=err.world_above) is not None
        for w in range(world + 1, err.world_above):
            assert reference(case, world=w) is None, w
    if all(option is None for option in offered):
        assert "no nearby option" in str(err)


def test_needed_tolerance_is_the_nearest_reachable_global_batch() -> None:
    # B = 100 on 1 x 100 x 1; world 30, micro <= 1, memory no object: reachable global batches
    # are 30, 60, 90, 120, ...; 90 is the nearest (|90 - 100| = 10), so the tolerance it needs
    # is 10 %, shown as "10.00%"; with 5 % the band [95, 105] holds no multiple of 30.
    model = ModelSpec(64, 1, 10**6)
    previous = TrainingSpec(1, 100, 1, 1, 128)
    with pytest.raises(NoFeasiblePlan) as info:
        replan(model, previous, 30, tolerance=0.05, mem_limit_gib=100, max_micro_batch_size=1)
    assert info.value.needed_tolerance == pytest.approx(0.10)
    assert "tolerance 10.00% (global batch 90, micro-batch 1)" in str(info.value)
    # The world sizes below 30 with a multiple in [95, 105]: 26 (104) is the nearest.
    assert info.value.world_below == 26
    assert "world size 26 (leave 4 ranks idle)" in str(info.value)


# --------------------------------------------------------------------------- tie-breaks by hand


def test_tie_on_accumulation_goes_to_the_smaller_count() -> None:
    # B = 10, tolerance 20 %: band [8, 12]. World 4, micro-batch <= 1: accumulation 2 gives 8 and
    # 3 gives 12, both 2 away from 10; the first found (2, the smaller) wins.
    model = ModelSpec(64, 1, 10**6)
    previous = TrainingSpec(1, 10, 1, 1, 128)
    plan = replan(model, previous, 4, tolerance=0.2, mem_limit_gib=100, max_micro_batch_size=1)
    assert plan.training.gradient_accumulation_steps == 2
    assert plan.training.global_batch_size == 8
    assert plan.deviation == pytest.approx(-0.2)


def test_tie_on_distance_goes_to_the_larger_micro_batch_first_found() -> None:
    # Same band [8, 12], micro-batch <= 3. micro 3: 12 (distance 2); micro 2: 8 (2); micro 1:
    # 8 or 12 (2). All tie at stage 1, so the first found, micro-batch 3 x 1, wins.
    model = ModelSpec(64, 1, 10**6)
    previous = TrainingSpec(1, 10, 1, 1, 128)
    plan = replan(model, previous, 4, tolerance=0.2, mem_limit_gib=100, max_micro_batch_size=3)
    t = plan.training
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.zero_stage) == (3, 1, 1)


def test_tie_on_distance_goes_to_the_lower_zero_stage_whatever_the_order_given() -> None:
    # Memory is no object, stages offered as (3, 1): every setting exists at both, so the lower
    # stage (1) wins the tie although stage 3 is found first.
    model = ModelSpec(64, 1, 10**6)
    previous = TrainingSpec(1, 10, 1, 1, 128)
    plan = replan(model, previous, 5, mem_limit_gib=100, max_micro_batch_size=2, zero_stages=(3, 1))
    t = plan.training
    assert (t.zero_stage, t.micro_batch_size, t.gradient_accumulation_steps) == (1, 2, 1)


# --------------------------------------------------------------------------- the memory model


def test_memory_model_by_hand() -> None:
    # P = 1 GiB-count of parameters (2**30); defaults 2, 4, 4 x 2 bytes; world 4.
    #   ZeRO-0: 2 + 4 + 8         = 14   GiB
    #   ZeRO-1: 2 + 4 + 8/4       =  8   GiB
    #   ZeRO-2: 2 + 4/4 + 8/4     =  5   GiB
    #   ZeRO-3: 2/4 + 4/4 + 8/4   =  3.5 GiB
    # Activations: 16 x micro 2 x seq 1024 x hidden 512 x 8 layers x 2 bytes = 2**28 B = 0.25 GiB
    model = ModelSpec(hidden_size=512, num_hidden_layers=8, num_parameters=GIB, dtype_bytes=2)
    expected_state = {0: 14.0, 1: 8.0, 2: 5.0, 3: 3.5}
    for zero, state in expected_state.items():
        m = estimate_memory(model, TrainingSpec(zero, 4, 2, 7, 1024))
        assert m.state_gib == state
        assert m.activations_gib == 0.25
        assert m.total_gib == state + 0.25
    # Every width is a parameter: fp32 weights, bf16 grads, one 8-byte slot, constant 34.
    # ZeRO-1: 4 + 2 + 8/4 = 8; activations 34/16 x 0.25 = 0.53125
    m = estimate_memory(
        model,
        TrainingSpec(1, 4, 2, 1, 1024),
        param_bytes=4,
        grad_bytes=2,
        optim_bytes=8,
        optim_slots=1,
        activation_constant=34,
    )
    assert (m.parameters_gib, m.gradients_gib, m.optimizer_gib) == (4.0, 2.0, 2.0)
    assert m.activations_gib == 0.53125


@settings(max_examples=200, deadline=None)
@given(models, previous_specs, memory_params)
def test_memory_model_matches_exact_rational_arithmetic(
    model: ModelSpec, training: TrainingSpec, memory: dict[str, int]
) -> None:
    p, w, z = model.num_parameters, training.world_size, training.zero_stage
    div = {k: (w if z >= k else 1) for k in (1, 2, 3)}
    params = Fraction(p * memory["param_bytes"], div[3] * GIB)
    grads = Fraction(p * memory["grad_bytes"], div[2] * GIB)
    optim = Fraction(p * memory["optim_bytes"] * memory["optim_slots"], div[1] * GIB)
    act = Fraction(
        memory["activation_constant"]
        * training.micro_batch_size
        * training.sequence_length
        * model.hidden_size
        * model.num_hidden_layers
        * model.dtype_bytes,
        GIB,
    )
    m = estimate_memory(model, training, **memory)
    assert m.state_gib == pytest.approx(float(params + grads + optim), rel=1e-12)
    assert m.activations_gib == pytest.approx(float(act), rel=1e-12)
    assert m.total_gib == pytest.approx(float(params + grads + optim + act), rel=1e-12)


# --------------------------------------------------------------------------- the 5B table

# hidden 4096, 28 layers, P = 4,832,071,680 = 4.5 x 2**30 + 233,472 parameters, so
#   p := P / 2**30 = 4.5 + 233472 / 2**30 = 4.500217437744140625 exactly.
# Per-GPU state (defaults 2, 4, 4 x 2 bytes), in GiB:
#   ZeRO-1: 2p + 4p + 8p/W = 27.00130462646484375 + 36.001739501953125 / W
#   ZeRO-2: 2p + 12p/W     =  9.00043487548828125 + 54.0026092529296875 / W
#   ZeRO-3: 14p/W          = 63.00304412841796875 / W
# Activations: 16 x m x 4096 x 4096 x 28 x 2 B = m x 896 x 2**24 B = 14m GiB.
# Previous: ZeRO-1 x 480 x 6 x 1 -> B = 2880; band [floor(2592.0), ceil(3168.0)] = [2592, 3168].
# Largest micro-batch under 120 GiB for W >= 8:
#   ZeRO-1: 14m <= 120 - 27.0013 - 36.0017/W, in (88.49, 93.00)  -> m <= 6  (7 x 14 = 98)
#   ZeRO-2: 14m <= 120 - 9.0004 - 54.0026/W,  in (104.2, 111.0)  -> m <= 7  (8 x 14 = 112)
#   ZeRO-3: 14m <= 120 - 63.0030/W,           in (112.1, 120)    -> m <= 8  (9 x 14 = 126)
MODEL_5B = ModelSpec(hidden_size=4096, num_hidden_layers=28, num_parameters=4_832_071_680)
PREVIOUS_5B = TrainingSpec(
    zero_stage=1,
    world_size=480,
    micro_batch_size=6,
    gradient_accumulation_steps=1,
    sequence_length=4096,
)
KW_5B: dict[str, object] = {"tolerance": 0.10, "mem_limit_gib": 120, "max_micro_batch_size": 32}
ZERO1_STATE = 27.00130462646484375  # 6p
ZERO1_OPTIM = 36.001739501953125  # 8p, divided by W

# world: (micro, accum, zero, global batch, deviation %, state GiB, activations GiB)
HAND_ROWS = {
    # 2880 / 8 = 360 = 6 x 60; ZeRO-1 allows m <= 6, so 6 x 60 is exact and found first.
    8: (6, 60, 1, 2880, 0.0, ZERO1_STATE + ZERO1_OPTIM / 8, 14 * 6),
    # 2880 / 96 = 30 = 6 x 5: exact at ZeRO-1, m = 6 first.
    96: (6, 5, 1, 2880, 0.0, ZERO1_STATE + ZERO1_OPTIM / 96, 14 * 6),
    # 2880 / 360 = 8. ZeRO-1: m = 6 needs accum in [ceil(2592/2160), 3168 // 2160] = [2, 1],
    # empty; m = 5: [ceil(2592/1800), 3168 // 1800] = [2, 1], empty; m = 4: accum 2 -> 2880.
    # ZeRO-3 m = 8 x 1 is exact too, but the tie goes to the lower stage.
    360: (4, 2, 1, 2880, 0.0, ZERO1_STATE + ZERO1_OPTIM / 360, 14 * 4),
    # Multiples of 408: 6 x 408 = 2448 < 2592, 7 x 408 = 2856 in band, 8 x 408 = 3264 > 3168.
    # m x accum = 7: ZeRO-2 7 x 1 and ZeRO-1 1 x 7 tie at distance 24; lower stage wins.
    # Deviation (2856 - 2880) / 2880 = -0.8333 %.
    408: (1, 7, 1, 2856, -0.83, ZERO1_STATE + ZERO1_OPTIM / 408, 14 * 1),
    # The previous world itself: 6 x 1 exact.
    480: (6, 1, 1, 2880, 0.0, ZERO1_STATE + ZERO1_OPTIM / 480, 14 * 6),
    # 5 x 488 = 2440 < 2592, 6 x 488 = 2928 in band, 7 x 488 = 3416 > 3168 -> 6 x 1 at ZeRO-1,
    # deviation 48 / 2880 = +1.6667 %.
    488: (6, 1, 1, 2928, 1.67, ZERO1_STATE + ZERO1_OPTIM / 488, 14 * 6),
    # 3 x 792 = 2376 < 2592, 4 x 792 = 3168 = the band's upper end (inclusive) -> 4 x 1,
    # deviation 288 / 2880 = +10 %.
    792: (4, 1, 1, 3168, 10.0, ZERO1_STATE + ZERO1_OPTIM / 792, 14 * 4),
}
# A world size W has a plan iff some multiple of W lies in [2592, 3168] (memory never binds:
# micro-batch 1 at ZeRO-1 needs at most 27.0013 + 4.5002 + 14 = 45.5 GiB for W >= 8). The k-th
# multiple is in band for W in [2592/k, 3168/k]: k = 3 -> [864, 1056], k = 4 -> [648, 792],
# k = 5 -> [518.4, 633.6], k = 6 -> [432, 528] (overlapping from here down). Multiples of 8 in
# the gaps (633.6, 648) and (792, 864) up to 800: 640 and 800.
HAND_INFEASIBLE = {640, 800}


def test_5b_table_rows_derived_by_hand() -> None:
    worlds = parse_world_range("8..800:8")
    assert worlds == [8 * k for k in range(1, 101)]
    rows = plan_table(MODEL_5B, PREVIOUS_5B, worlds, **KW_5B)
    assert [r["world"] for r in rows] == worlds
    by_world = {r["world"]: r for r in rows}
    for world, (micro, accum, zero, global_batch, dev_pct, state, act) in HAND_ROWS.items():
        row = by_world[world]
        assert row["reason"] is None, row
        assert (row["micro"], row["accum"], row["zero"]) == (micro, accum, zero), world
        assert row["global_batch"] == global_batch == world * micro * accum
        assert row["deviation_pct"] == dev_pct
        assert row["state_gib"] == pytest.approx(state, abs=0.0006)
        assert row["activations_gib"] == pytest.approx(act, abs=0.0006)
        assert row["total_gib"] == pytest.approx(state + act, abs=0.0006)
        assert row["total_gib"] <= 120
    infeasible = {r["world"] for r in rows if r["reason"] is not None}
    assert infeasible == HAND_INFEASIBLE
    for r in rows:
        if r["reason"] is None:
            assert 2592 <= r["global_batch"] <= 3168
            assert r["total_gib"] <= 120


def test_5b_no_plan_at_800_names_the_tolerance_and_the_idle_ranks() -> None:
    # 3 x 800 = 2400 and 4 x 800 = 3200 straddle the band [2592, 3168]. Nearest reachable batch:
    # 3200 (|3200 - 2880| = 320 < 480), largest micro-batch giving it 4 x 1; it needs
    # 320 / 2880 = 11.11 % (printed rounded up: 11.12 %). Below 800: 799..793 have no multiple
    # in band (4 x 793 = 3172 > 3168, 3 x 799 = 2397 < 2592); 4 x 792 = 3168 -> leave 8 idle.
    with pytest.raises(NoFeasiblePlan) as info:
        replan(MODEL_5B, PREVIOUS_5B, 800, **KW_5B)  # type: ignore[arg-type]
    err = info.value
    assert str(err) == (
        "world size 800 has no plan: global batch 2880 ±10% = [2592, 3168] under 120 GiB/GPU; "
        "nearest options: tolerance 11.12% (global batch 3200, micro-batch 4), "
        "or world size 792 (leave 8 ranks idle)"
    )
    assert err.needed_tolerance == pytest.approx(320 / 2880)
    assert err.world_below == 792
    assert err.needed_mem_limit_gib is None
    assert err.world_above is None
    assert err.band == (2592, 3168)
    assert isinstance(err, CkptdError)
    assert isinstance(err, ValueError)
    # The table carries the same reason.
    (row,) = plan_table(MODEL_5B, PREVIOUS_5B, [800], **KW_5B)
    assert row["reason"] == str(err)
    assert row["micro"] is None and row["total_gib"] is None


def test_5b_no_plan_on_one_gpu_names_the_memory_limit_and_a_larger_world() -> None:
    # W = 1: every stage holds the whole state, 14p = 63.0030 GiB, plus 14 GiB for micro-batch
    # 1 = 77.0030 GiB > 60 (printed rounded up: 77.01), with 2880 accumulation steps.
    # W = 2: ZeRO-3 holds 63.0030 / 2 = 31.50 GiB + 14 = 45.50 <= 60 and 2 x 1 x 1440 = 2880.
    with pytest.raises(NoFeasiblePlan) as info:
        replan(MODEL_5B, PREVIOUS_5B, 1, tolerance=0.1, mem_limit_gib=60, max_micro_batch_size=32)
    err = info.value
    assert str(err) == (
        "world size 1 has no plan: global batch 2880 ±10% = [2592, 3168] under 60 GiB/GPU; "
        "nearest options: mem_limit_gib 77.01 (ZeRO-1, micro-batch 1, accumulation 2880), "
        "or world size 2"
    )
    assert err.needed_mem_limit_gib == pytest.approx(63.00304412841796875 + 14)
    assert err.needed_tolerance is None
    assert err.world_above == 2
    assert err.world_below is None


def test_band_is_exact_for_decimal_tolerances() -> None:
    # 10 x 1.1 is 11.000000000000002 in binary floating point; the band must still end at 11.
    assert batch_band(10, 0.1) == (9, 11)
    assert batch_band(2880, 0.10) == (2592, 3168)
    assert batch_band(7, 0.0) == (7, 7)
    assert batch_band(3, 0.5) == (1, 5)  # floor(1.5) = 1, ceil(4.5) = 5


# --------------------------------------------------------------------------- records and input


def test_training_spec_json_round_trip_with_version() -> None:
    t = PREVIOUS_5B
    record = t.to_json()
    assert record == {
        "version": 1,
        "zero_stage": 1,
        "world_size": 480,
        "micro_batch_size": 6,
        "gradient_accumulation_steps": 1,
        "sequence_length": 4096,
    }
    assert TrainingSpec.from_json(record) == t
    assert TrainingSpec.from_json(json.dumps(record)) == t
    assert t.global_batch_size == 2880


def test_training_spec_from_json_rejects_unknown_versions_and_missing_fields() -> None:
    record = PREVIOUS_5B.to_json()
    with pytest.raises(InvalidSpec, match=r"version 2 is not supported \(expected 1\)"):
        TrainingSpec.from_json({**record, "version": 2})
    del record["sequence_length"]
    with pytest.raises(InvalidSpec, match="lacks sequence_length"):
        TrainingSpec.from_json(record)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TrainingSpec(4, 8, 1, 1, 128), "ZeRO stage must be 0, 1, 2 or 3, got 4"),
        (lambda: TrainingSpec(1, 0, 1, 1, 128), "TrainingSpec.world_size must be a positive"),
        (lambda: ModelSpec(64, 2, -5), "ModelSpec.num_parameters must be a positive int, got -5"),
        (
            lambda: replan(MODEL_5B, PREVIOUS_5B, 0, mem_limit_gib=1, max_micro_batch_size=1),
            "replan.world_size must be a positive int, got 0",
        ),
        (
            lambda: replan(
                MODEL_5B, PREVIOUS_5B, 8, tolerance=-0.1, mem_limit_gib=1, max_micro_batch_size=1
            ),
            "tolerance must be finite and >= 0, got -0.1",
        ),
        (
            lambda: replan(
                MODEL_5B, PREVIOUS_5B, 8, mem_limit_gib=1, max_micro_batch_size=1, zero_stages=()
            ),
            "zero_stages must name at least one ZeRO stage",
        ),
    ],
)
def test_bad_arguments_raise_invalid_spec_naming_the_value(make: object, message: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        make()  # type: ignore[operator]
    assert message in str(info.value)
    assert isinstance(info.value, CkptdError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("4", [4]),
        ("2,3,4", [2, 3, 4]),
        ("8..12", [8, 9, 10, 11, 12]),
        ("8..800:8", list(range(8, 801, 8))),
        ("8..30:8", [8, 16, 24]),
        (" 16, 1..3 ,16", [1, 2, 3, 16]),
    ],
)
def test_parse_world_range(spec: str, expected: list[int]) -> None:
    assert parse_world_range(spec) == expected


@pytest.mark.parametrize("spec", ["", "0", "8..4", "a..8", "8..16:0", "1,,2", "-3", "8..16:x"])
def test_parse_world_range_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(InvalidSpec, match="world range"):
        parse_world_range(spec)


def test_renderings_show_every_row_and_the_reason() -> None:
    rows = plan_table(MODEL_5B, PREVIOUS_5B, [488, 800], **KW_5B)
    text = render_markdown(rows)
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("| world | micro | accum | ZeRO | global batch | deviation %")
    # 488: 6 x 1 at ZeRO-1 = 2928, +1.67 %, state 27.075, activations 84, total 111.075.
    assert lines[2] == "| 488 | 6 | 1 | 1 | 2928 | +1.67 | 27.075 | 84.000 | 111.075 |  |"
    assert lines[3].startswith("| 800 | — | — | — | — | — | — | — | — | world size 800 has no")
    decoded = json.loads(render_json(rows))
    assert decoded == rows
    assert decoded[1]["reason"].endswith("(leave 8 ranks idle)")


def test_large_accumulation_counts_are_found_exactly() -> None:
    # B = 1000 x 8 x 1000 = 8,000,000 onto one rank with micro-batch <= 8: 8 x 1,000,000.
    model = ModelSpec(64, 1, 10**6)
    previous = TrainingSpec(1, 1000, 8, 1000, 128)
    plan = replan(model, previous, 1, mem_limit_gib=1000, max_micro_batch_size=8)
    assert plan.training.global_batch_size == 8 * 10**6
    assert math.isclose(plan.deviation, 0.0)
