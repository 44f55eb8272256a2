"""Checkpoints written by earlier versions of ckptd, kept as fixtures (tests/fixtures/formatN),
read by today's code: loads exact, verified, listed, inspected."""

from __future__ import annotations

import json
import os

import torch

import ckptd
from ckptd.cli import main as cli_main
from ckptd.manifest import layout as L
from ckptd.manifest.parse import decode, head, whole_doc

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FORMAT4 = os.path.join(FIXTURES, "format4")


def _format4_dest(rank: int = 0) -> dict[str, object]:
    return {
        "model": {"w": torch.zeros(6, 8), "b": torch.zeros(4),
                  "e": torch.zeros(6, dtype=torch.bfloat16)},
        "optim": {"lr": 0.0, "betas": (0.0, 0.0)},
        "rng": ckptd.Local(torch.zeros(2, dtype=torch.int64)),
        "data": ckptd.Local({"position": -1, "blob": b""}),
        "step": -1,
    }


def test_a_checkpoint_of_format_4_loads_exactly_on_one_and_two_ranks():
    """Written by ckptd before the compact chunk rows (manifest version 4, partials of version
    2): two ranks, zstd-planes frames in binary tables, a tensor sharded over both, two
    replicated ones (one written by each rank), bytes, a tuple and per-rank Locals."""
    for world, rank in ((1, 0), (2, 1)):
        dst = _format4_dest()
        with ckptd.Checkpointer(FORMAT4, rank=rank, world_size=world, read_only=True) as c:
            result = c.load(dst)
        assert result.step == 5 and dst["step"] == 5
        model = dst["model"]
        assert isinstance(model, dict)
        assert torch.equal(model["w"], torch.arange(48.0).reshape(6, 8))
        assert torch.equal(model["b"], torch.full((4,), 0.5))
        assert torch.equal(model["e"], torch.arange(6, dtype=torch.bfloat16))
        assert dst["optim"] == {"lr": 0.25, "betas": (0.9, 0.95)}
        rng, data = dst["rng"], dst["data"]
        assert isinstance(rng, ckptd.Local) and isinstance(data, ckptd.Local)
        assert torch.equal(rng.value, torch.tensor([rank, 7]))
        assert data.value == {"position": 100 + rank, "blob": b"\x00\x01" + bytes([rank])}


def test_a_checkpoint_of_format_4_verifies_lists_and_inspects(capsys):
    assert cli_main(["verify", FORMAT4]) == 0
    assert "step 5: 5 tensors, 6 chunks" in capsys.readouterr().out
    assert cli_main(["ls", "--json", FORMAT4]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["step"], row["state"], row["world_size"], row["tensors"]) == (
        5, "committed", 2, 5)
    assert cli_main(["inspect", "--json", FORMAT4]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 5 and sorted(doc["tensors"]) == [
        "__local__/0/rng", "__local__/1/rng", "model/b", "model/e", "model/w"]
    assert len(doc["tensors"]["model/w"]["chunks"]) == 2


def test_the_head_and_the_whole_document_of_a_manifest_of_format_4():
    with open(os.path.join(FORMAT4, L.manifest_path(5)), "rb") as f:
        raw = f.read()
    got, whole, doc = head(raw, "m"), decode(raw, "m"), whole_doc(raw, "m")
    assert doc["version"] == 4 and got.generation == 1 and got.world_size == 2
    assert got.tensors == {n: (t.dtype_name, t.shape) for n, t in whole.tensors.items()}
    assert got.nbytes == whole.nbytes == 6 * 8 * 4 + 4 * 4 + 6 * 2 + 2 * 2 * 8
    w = doc["tensors"]["model/w"]
    assert (w["dtype"], w["shape"]) == ("float32", [6, 8])
    assert [c["box"] for c in w["chunks"]] == [[[0, 0], [3, 8]], [[3, 0], [3, 8]]]
    assert [(c.box.offsets, c.rank, c.length, c.codec) for c in whole.tensors["model/w"].chunks
            ] == [((0, 0), 0, 96, "zstd-planes"), ((3, 0), 1, 96, "zstd-planes")]


def test_a_checkpoint_of_format_4_reshards_offline_and_exports(tmp_path, capsys):
    """The offline reshard and the safetensors export read a version-4 manifest; the reshard
    writes one of today's version."""
    out = str(tmp_path / "resharded")
    assert cli_main(["reshard", FORMAT4, "--to-world", "3", "--out", out]) == 0
    with open(os.path.join(out, L.manifest_path(5)), "rb") as f:
        assert json.loads(f.read())["version"] == 5
    for rank in range(3):
        dst = _format4_dest()
        with ckptd.Checkpointer(out, rank=rank, world_size=3, read_only=True) as c:
            assert c.load(dst, strict=False).step == 5
        model = dst["model"]
        assert isinstance(model, dict)
        assert torch.equal(model["w"], torch.arange(48.0).reshape(6, 8))
        assert torch.equal(model["e"], torch.arange(6, dtype=torch.bfloat16))
    hf = tmp_path / "hf"
    assert cli_main(["export", FORMAT4, "--format", "safetensors", "--out", str(hf),
                     "--select", "model/*", "--strip-prefix", "model/", "--no-config"]) == 0
    capsys.readouterr()
    from safetensors.torch import load_file

    [file] = list(hf.glob("*.safetensors"))
    got = load_file(str(file))
    assert sorted(got) == ["b", "e", "w"]
    assert torch.equal(got["w"], torch.arange(48.0).reshape(6, 8))
    assert torch.equal(got["b"], torch.full((4,), 0.5))


def test_inspect_json_prints_the_stored_document_of_every_format(capsys):
    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    for name in ("format1", "format2", "format4"):
        root = os.path.join(fixtures, name)
        assert cli_main(["inspect", "--json", root]) == 0, name
        doc = json.loads(capsys.readouterr().out)
        step = ckptd.Checkpointer(root, read_only=True).latest_step()
        raw = open(os.path.join(root, L.manifest_path(step)), "rb").read()
        assert doc == whole_doc(raw, name) and doc["step"] == step and doc["tensors"], name
