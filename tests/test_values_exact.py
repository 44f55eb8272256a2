"""Non-tensor values come back exactly: bytes as the same bytes (never unpickled), tuples as
tuples, per-rank opaque state (a dataloader's pickled position) per rank."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from test_save_load import save_as_ranks

import ckptd
from ckptd.errors import CorruptCheckpoint, StateMismatch
from ckptd.manifest import layout as L


class _Tripwire:
    """Unpickling this writes a file: proof that something unpickled the bytes."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[override]
        return (open, (self.path, "w"))


def test_local_bytes_come_back_as_the_same_bytes_and_are_never_unpickled(tmp_path):
    marker = str(tmp_path / "unpickled")
    blob = pickle.dumps({"sampler": _Tripwire(marker), "epoch": 3})
    state = {
        "dataloader": ckptd.Local({"dp_rank_0": blob, "world_size": 1}),
        "raw": ckptd.Local(b"\x00\xff opaque"),
        "global_blob": b"\x80\x04 same on every rank",
    }
    with ckptd.Checkpointer(str(tmp_path / "root")) as ck:
        ck.save(state, step=5)
        dst = {"dataloader": ckptd.Local({}), "raw": ckptd.Local(b""), "global_blob": b""}
        ck.load(dst)
    assert dst["dataloader"].value == {"dp_rank_0": blob, "world_size": 1}
    assert type(dst["dataloader"].value["dp_rank_0"]) is bytes
    assert dst["raw"].value == b"\x00\xff opaque" and dst["global_blob"] == state["global_blob"]
    assert not os.path.exists(marker)


def test_per_rank_bytes_saved_on_two_ranks_load_per_rank_on_three(tmp_path):
    url = str(tmp_path / "root")
    states = [{"dataloader": ckptd.Local({f"dp_rank_{r}": bytes([r]) * 9, "world_size": 2})}
              for r in range(2)]
    save_as_ranks(url, states, step=4)
    got = []
    for r in range(3):
        with ckptd.Checkpointer(url, rank=r, world_size=3, run_id="three", read_only=True) as ck:
            dst = {"dataloader": ckptd.Local({"fresh": r})}
            ck.load(dst)
            got.append(dst["dataloader"].value)
    assert got == [{"dp_rank_0": b"\x00" * 9, "world_size": 2},
                   {"dp_rank_1": b"\x01" * 9, "world_size": 2},
                   {"fresh": 2}]  # a rank the saved world did not have keeps its own


def test_adamw_betas_saved_are_restored_as_a_tuple(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.95))
    with ckptd.Checkpointer(str(tmp_path / "root")) as ck:
        ck.save({"optim": opt.state_dict(), "pair": [1, 2], "nested": (1, (2, "x"), [3])}, step=1)
        fresh = torch.optim.AdamW(model.parameters())  # betas (0.9, 0.999)
        dst = {"optim": fresh.state_dict(), "pair": [0, 0], "nested": [0, [0, ""], [0]]}
        ck.load(dst)
        raw = json.loads(ck.storage.read_bytes(f"{L.step_dir(1)}/{L.MANIFEST}"))
    betas = dst["optim"]["param_groups"][0]["betas"]
    assert betas == (0.8, 0.95) and type(betas) is tuple
    assert dst["pair"] == [1, 2] and type(dst["pair"]) is list
    assert dst["nested"] == (1, (2, "x"), [3]) and type(dst["nested"][1]) is tuple
    assert raw["version"] >= 4  # "types" since version 4
    assert raw["types"] == {"optim/param_groups/0/betas": "tuple", "nested": "tuple",
                            "nested/1": "tuple"}


def test_a_bytes_value_that_is_not_base64_is_a_corrupt_checkpoint(tmp_path):
    root = tmp_path / "root"
    with ckptd.Checkpointer(str(root)) as ck:
        ck.save({"blob": b"abc"}, step=1)
    from ckptd.manifest.encode import encode_doc
    from ckptd.manifest.parse import whole_doc

    path = root / L.step_dir(1) / L.MANIFEST
    doc = whole_doc(path.read_bytes(), str(path))
    doc["values"]["blob"] = "not base64!"
    path.write_bytes(encode_doc(doc))
    with ckptd.Checkpointer(str(root)) as ck, pytest.raises(CorruptCheckpoint,
                                                           match=r"blob: a bytes value is not"):
        ck.load({"blob": b""})


def test_an_object_inside_local_is_refused_without_advising_local(tmp_path):
    with ckptd.Checkpointer(str(tmp_path / "root")) as ck:
        with pytest.raises(StateMismatch) as e:
            ck.save({"dl": ckptd.Local({"s": {1, 2}})}, step=1)
    assert "inside ckptd.Local" in str(e.value) and "wrap" not in str(e.value)
