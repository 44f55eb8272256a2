"""Layout files: parsing (TOML and JSON), the pieces a layout gives each target rank, errors that
name the tensor and the rule, and the starting layout ``ckptd layout`` infers.

:func:`layout_doc` writes, for every layout of ``transformer_state``, the layout file that
describes it; the tests check that it yields exactly the pieces that layout's ranks describe
(``tests/test_reshard_offline.py`` uses the same files to reshard)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import transformer_state as ts
from transformer_state import LAYOUTS, Layout

from ckptd.cli import main
from ckptd.loader.infer import infer_layout
from ckptd.loader.layout_file import LayoutError, dumps, from_doc, parse_layout
from ckptd.loader.targets import Resolver, resolve, split_dim
from ckptd.manifest import Manifest, TensorEntry
from ckptd.regions import Box
from ckptd.sharding import describe, local_name

ZERO_GROUPS = [{"match": "model/*", "kind": "params"},
               {"match": "optim/exp_avg/*", "kind": "optimizer"},
               {"match": "optim/exp_avg_sq/*", "kind": "optimizer"}]


def _dtensor_rule(p: ts.Param) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    dp, tp = ts._dtensor_placements(p)
    rule: dict[str, Any] = {"match": f"*/{p.fqn}"}
    if isinstance(dp, Shard):
        rule["dp_dim"] = dp.dim
    if isinstance(tp, Shard):
        rule.update(tp_dim=tp.dim, split="chunk")
    if "dp_dim" not in rule and "tp_dim" not in rule:
        rule["replicated"] = True
    return rule


def _rule(p: ts.Param) -> dict[str, Any]:
    rule: dict[str, Any] = {"match": f"*/{p.fqn}"}
    if p.split == "vocab":
        rule.update(tp_dim=0, split="padded", divisible_by=ts.VOCAB_DIVISIBLE_BY)
    elif p.split == "column":
        rule["tp_dim"] = 0
    elif p.split == "row":
        rule["tp_dim"] = 1
    else:
        rule["replicated"] = True
    return rule


def layout_doc(lay: Layout) -> dict[str, Any]:
    """The layout file (as a dict) of a transformer_state layout."""
    return {
        "version": 1,
        "parallel": {"tp": lay.tp, "pp": lay.pp, "order": ["tp", "dp", "pp"]},
        "pipeline": {"layer": r"layers\.(\d+)\.", "num_layers": ts.LAYERS,
                     "first": ["*/embed.weight"], "last": ["*/norm_f.weight", "*/lm_head.weight"]},
        "zero": {"stage": lay.zero, "align": lay.flat_align, "buckets": lay.buckets,
                 "order": [f"*/{p.fqn}" for p in ts.PARAMS], "group": ZERO_GROUPS},
        "rule": [_dtensor_rule(p) if lay.dtensor else _rule(p) for p in ts.PARAMS],
    }


def layout_text(lay: Layout, fmt: str) -> str:
    return dumps(from_doc(layout_doc(lay), lay.name), fmt)


def reference_manifest(world: int = 4) -> Manifest:
    """A manifest with the reference's tensors (and ``world`` ranks' Local rng), no chunks."""
    tensors = {n: TensorEntry(t.dtype, tuple(t.shape)) for n, t in ts.reference().items()}
    for r in range(world):
        rng = ts.rng_state(r)
        tensors[local_name(r, "rng")] = TensorEntry(rng.dtype, tuple(rng.shape))
    return Manifest(ts.STEP, "a-1", world, 0.0, tensors)


def described(lay: Layout, rank: int) -> set[tuple[str, Box]]:
    st = ts.build_state(lay, rank, ts.reference())
    return {(p.name, p.box) for p in describe(st.state, rank, lay.world_size).pieces}


@pytest.mark.parametrize("name", [n for n, lay in LAYOUTS.items() if not lay.dtensor])
def test_layout_file_gives_each_rank_exactly_the_pieces_its_state_describes(name: str) -> None:
    lay = LAYOUTS[name]
    fmt = "json" if lay.world_size % 2 else "toml"
    spec = parse_layout(layout_text(lay, fmt), name)
    got = resolve(spec, reference_manifest(lay.world_size), lay.world_size)
    for rank in range(lay.world_size):
        mine = {(t.name, t.box) for t in got.ranks[rank]}
        want = described(lay, rank)
        assert sorted(mine - want, key=str) == [] and sorted(want - mine, key=str) == []


def test_dtensor_layout_rules_give_torch_chunk_boxes() -> None:
    """dp_dim shards first, then tp_dim with torch.chunk rounding (what DTensor does)."""
    spec = from_doc(layout_doc(LAYOUTS["dtensor_dp2_tp2"]))
    got = resolve(spec, reference_manifest(), 4)
    boxes = {r: {t.box for t in got.ranks[r] if t.name == "model/lm_head.weight"}
             for r in range(4)}
    # 13 rows: dp 7/6, then tp 4/3 and 3/3
    assert boxes == {0: {Box((0, 0), (4, 8))}, 1: {Box((4, 0), (3, 8))},
                     2: {Box((7, 0), (3, 8))}, 3: {Box((10, 0), (3, 8))}}
    down = {t.box for t in got.ranks[3] if t.name == "model/layers.0.mlp.down.weight"}
    assert down == {Box((4, 10), (4, 10))}


def test_split_modes() -> None:
    assert [split_dim(13, 2, i, "chunk") for i in range(2)] == [(0, 7), (7, 6)]
    assert [split_dim(13, 2, i, "padded", 4) for i in range(2)] == [(0, 8), (8, 5)]
    assert [split_dim(12, 3, i, "even") for i in range(3)] == [(0, 4), (4, 4), (8, 4)]
    with pytest.raises(ValueError):
        split_dim(13, 2, 0, "even")


def test_fused_parts_are_split_one_by_one() -> None:
    m = Manifest(1, "a-1", 1, 0.0, {"m/qkv.weight": TensorEntry(torch.float32, (12, 4))})
    spec = parse_layout('[parallel]\ntp = 2\n[[rule]]\nmatch = "*qkv*"\ntp_dim = 0\n'
                        "fused = [8, 2, 2]\n")
    got = resolve(spec, m, 2)
    assert [t.box for t in got.ranks[1]] == [Box((4, 0), (4, 4)), Box((9, 0), (1, 4)),
                                            Box((11, 0), (1, 4))]


def test_a_tensor_no_rule_covers_is_named() -> None:
    spec = parse_layout('[[rule]]\nmatch = "model/*"\nreplicated = true\n', "mine.toml")
    with pytest.raises(LayoutError, match=r"layout mine.toml: no rule matches optim/exp_avg/"
                                          r"embed.weight, .*add a \[\[rule\]\]"):
        resolve(spec, reference_manifest(), 2)


def test_a_split_that_does_not_divide_names_the_tensor_and_the_rule() -> None:
    doc = layout_doc(LAYOUTS["tp2"])
    doc["parallel"]["tp"] = 3
    with pytest.raises(LayoutError) as err:
        resolve(from_doc(doc, "tp3.json"), reference_manifest(), 3)
    assert str(err.value) == (
        "layout tp3.json: model/layers.0.attn.k.weight [8, 8]: rule 4 (match "
        "'*/layers.0.attn.k.weight', tp_dim 0): dim 0 of size 8 does not divide by tp 3")


def test_pipeline_stage_needs_a_layer_index_or_first_last() -> None:
    doc = layout_doc(LAYOUTS["pp2"])
    doc["pipeline"]["last"] = ["*/lm_head.weight"]
    with pytest.raises(LayoutError, match=r"model/norm_f.weight: no pipeline stage"):
        resolve(from_doc(doc, "pp.toml"), reference_manifest(), 2)


@pytest.mark.parametrize("text, message", [
    ('[[rule]]\nmatch = "*"\ntp_dim = 0\nreplicated = true\n', "replicated excludes tp_dim"),
    ('[[rule]]\nmatch = "*"\ntp_dmi = 0\n', r"rule 1: unknown key\(s\) \['tp_dmi'\]"),
    ('[[rule]]\nmatch = "*"\nsplit = "odd"\ntp_dim = 0\n', "split must be one of"),
    ('[parallel]\norder = ["tp", "pp"]\n', "order must list"),
    ('[zero]\nstage = 4\n', "ZeRO stage must be 0, 1, 2 or 3"),
    ("[parallel\n", "not valid TOML"),
    ('{"rule": [{"match": 3}]}', "match must be a glob"),
])
def test_malformed_layout_files_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        parse_layout(text, "bad")


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_layout_files_round_trip_through_toml_and_json(fmt: str) -> None:
    spec = from_doc(layout_doc(LAYOUTS["tp2_pp2_dp2_zero3"]), "x")
    again = parse_layout(dumps(spec, fmt, header="a header"), "x", fmt)
    assert again == spec


def test_inferred_layout_matches_megatron_style_splits_and_covers_everything() -> None:
    m = reference_manifest()
    spec = infer_layout(m, tp=2, pp=2, zero=1)
    res = Resolver(spec, m, 8)
    assert res.rule("model/layers.0.attn.q.weight").tp_dim == 0
    assert res.rule("optim/exp_avg/layers.1.mlp.down.weight").tp_dim == 1
    assert res.rule("model/layers.0.attn_norm.weight").replicated
    emb = res.rule("model/embed.weight")
    assert (emb.tp_dim, emb.split) == (0, "chunk")  # 13 rows over tp 2
    assert res.stage["model/embed.weight"] == 0 and res.stage["model/lm_head.weight"] == 1
    assert res.stage["model/layers.1.mlp.up.weight"] == 1
    assert res.group["optim/exp_avg/norm_f.weight"] is not None
    assert res.group["model/norm_f.weight"] is None  # parameters are flat at stage 3 only
    covered: dict[str, int] = {}
    for targets in res.assignment().ranks:
        for t in targets:
            covered[t.name] = covered.get(t.name, 0) + t.box.numel
    assert all(covered[n] >= t.numel() for n, t in ts.reference().items())


def test_layout_command_writes_a_file_that_reshard_accepts(tmp_path: Any, capsys: Any) -> None:
    from test_save_load import save_as_ranks

    lay = LAYOUTS["dp2_tp2"]
    root = str(tmp_path / "src")
    save_as_ranks(root, [ts.build_state(lay, r, ts.reference()).state for r in range(4)],
                  ts.STEP)
    out = str(tmp_path / "layout.json")
    assert main(["layout", root, "--tp", "2", "--world", "6", "--out", out]) == 0
    assert json.loads(open(out).read())["parallel"]["tp"] == 2
    assert main(["layout", root, "--tp", "3", "--world", "6"]) == 0  # to stdout: a TOML draft
    text = capsys.readouterr().out
    assert "torch.chunk rounding" in text and "[[rule]]" in text
    assert main(["reshard", root, "--to-world", "6", "--layout", out, "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in report["ranks"]] == list(range(6))
    # small target ranks are read together, in waves: a wave's reads are shared out over its
    # ranks in proportion to their writes
    assert report["tp"] == 2 and sum(r["ranges"] for r in report["ranks"]) > 0
    # a box the DP replicas of a TP rank all hold is written once (by its first holder)
    assert all(r["read_bytes"] >= r["write_bytes"] for r in report["ranks"])
    assert sum(r["write_bytes"] > 0 for r in report["ranks"]) >= 2


def test_the_example_in_docs_layouts_md_parses() -> None:
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "layouts.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.S)
    assert block is not None
    spec = parse_layout(block.group(1), "layouts.md")
    assert (spec.tp, spec.pp, spec.zero.stage, len(spec.rules)) == (8, 4, 1, 5)
    assert spec.rules[1].fused == (8192, 1024, 1024)
