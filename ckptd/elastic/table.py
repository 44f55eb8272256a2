"""The elastic batch table: :func:`~ckptd.elastic.replan` over a range of world sizes.

This is what ``ckptd plan`` prints. Rows are plain dicts with the same keys whether the world
size has a plan or not (``reason`` is ``None`` for a plan; the numbers are ``None`` otherwise),
so the JSON rendering is a stable machine-readable format.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from ckptd.elastic.search import InvalidSpec, ModelSpec, NoFeasiblePlan, TrainingSpec, planner

# Row keys in order, with the Markdown column header of each.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("world", "world"),
    ("micro", "micro"),
    ("accum", "accum"),
    ("zero", "ZeRO"),
    ("global_batch", "global batch"),
    ("deviation_pct", "deviation %"),
    ("state_gib", "state GiB"),
    ("activations_gib", "activations GiB"),
    ("total_gib", "total GiB"),
    ("reason", "reason"),
)


def parse_world_range(spec: str) -> list[int]:
    """World sizes from a compact spec: ``"4"``, ``"2,3,4"``, ``"8..64"`` (step 1) or
    ``"8..800:8"`` (both ends included); comma-separated items may mix these forms.

    The result is sorted and without duplicates.

    Args:
        spec: the spec, as above.

    Returns:
        The world sizes, ascending.

    Raises:
        InvalidSpec: an empty spec, a size below 1, or a range that ends before it starts.

    Example:
        from ckptd import elastic

        assert elastic.parse_world_range("8..32:8") == [8, 16, 24, 32]
        assert elastic.parse_world_range("1,4..6") == [1, 4, 5, 6]
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidSpec(f"world range must be a non-empty string, got {spec!r}")
    worlds: set[int] = set()
    for item in spec.split(","):
        item = item.strip()
        if ".." in item:
            bounds, _, step_text = item.partition(":")
            start_text, _, stop_text = bounds.partition("..")
            start = _world_int(spec, start_text)
            stop = _world_int(spec, stop_text)
            step = _world_int(spec, step_text) if step_text else 1
            if stop < start:
                raise InvalidSpec(f"world range {spec!r}: {item!r} ends before it starts")
            worlds.update(range(start, stop + 1, step))
        else:
            worlds.add(_world_int(spec, item))
    return sorted(worlds)


def _world_int(spec: str, text: str) -> int:
    text = text.strip()
    if not text.isdigit() or int(text) < 1:
        raise InvalidSpec(
            f"world range {spec!r}: {text!r} is not a positive integer "
            "(expected e.g. '4', '2,3,4', '8..64' or '8..800:8')"
        )
    return int(text)


def plan_table(
    model: ModelSpec, previous: TrainingSpec, worlds: Iterable[int], **replan_kwargs: Any
) -> list[dict[str, Any]]:
    """One row per world size: the plan :func:`~ckptd.elastic.replan` picks, or why none fits.

    ``replan_kwargs`` are :func:`~ckptd.elastic.replan`'s keyword arguments
    (``mem_limit_gib`` and ``max_micro_batch_size`` are required). GiB figures are rounded to
    3 decimals and the deviation (in percent) to 2.

    Args:
        model: the model's sizes.
        previous: the settings to stay near.
        worlds: the world sizes, one row each.
        replan_kwargs: :func:`~ckptd.elastic.replan`'s keyword arguments.

    Returns:
        The rows: dicts with ``world``, ``micro``, ``accum``, ``zero``, ``global_batch``,
        ``deviation_pct``, ``state_gib``, ``activations_gib``, ``total_gib`` (None without a
        plan) and ``reason`` (why there is none).

    Raises:
        InvalidSpec: bad arguments.

    Example:
        from ckptd import elastic

        m = elastic.ModelSpec(hidden_size=4096, num_hidden_layers=28,
                              num_parameters=4_832_071_680)
        rows = elastic.plan_table(m, elastic.TrainingSpec(1, 480, 6, 1, 4096), [488, 800],
                                  mem_limit_gib=120, max_micro_batch_size=32)
        assert [(r["world"], r["global_batch"], r["deviation_pct"]) for r in rows] == [
            (488, 2928, 1.67), (800, None, None)]
        assert rows[1]["reason"]
    """
    plan = planner(model, previous, **replan_kwargs)
    rows: list[dict[str, Any]] = []
    for world in worlds:
        row: dict[str, Any] = dict.fromkeys(key for key, _ in COLUMNS)
        row["world"] = world
        try:
            p = plan(world)
        except NoFeasiblePlan as e:
            row["reason"] = str(e)
        else:
            t = p.training
            row.update(
                micro=t.micro_batch_size,
                accum=t.gradient_accumulation_steps,
                zero=t.zero_stage,
                global_batch=t.global_batch_size,
                deviation_pct=round(p.deviation * 100, 2),
                state_gib=round(p.memory.state_gib, 3),
                activations_gib=round(p.memory.activations_gib, 3),
                total_gib=round(p.memory.total_gib, 3),
            )
        rows.append(row)
    return rows


def render_json(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a JSON array (one object per world size), for ``ckptd plan --json``.

    Args:
        rows: :func:`plan_table`'s rows.

    Returns:
        The JSON text.

    Example:
        import json
        from ckptd import elastic

        rows = [{"world": 2, "global_batch": 6, "reason": None}]
        assert json.loads(elastic.render_json(rows)) == rows
    """
    return json.dumps(list(rows), indent=2)


def render_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table; a world size without a plan shows its reason.

    Args:
        rows: :func:`plan_table`'s rows.

    Returns:
        The table's text: a header, a rule and one line per row.

    Example:
        from ckptd import elastic

        table = elastic.render_markdown([{
            "world": 2, "micro": 1, "accum": 3, "zero": 1, "global_batch": 6,
            "deviation_pct": 0.0, "state_gib": 1.5, "activations_gib": 0.25,
            "total_gib": 1.75, "reason": None}])
        header, rule, row = table.splitlines()
        assert header.startswith("| world | micro | accum | ZeRO |")
        assert row == "| 2 | 1 | 3 | 1 | 6 | +0.00 | 1.500 | 0.250 | 1.750 |  |"
    """
    header = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "|".join(":---" if key == "reason" else "---:" for key, _ in COLUMNS) + "|"
    lines = [header, rule]
    for row in rows:
        cells = [_cell(key, row.get(key)) for key, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "" if key == "reason" else "—"
    if key == "deviation_pct":
        return f"{value:+.2f}"
    if key.endswith("_gib"):
        return f"{value:.3f}"
    if key == "reason":
        return str(value).replace("|", "\\|")
    return str(value)
