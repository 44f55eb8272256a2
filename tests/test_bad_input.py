"""Corrupted, partial, foreign or malicious checkpoints and mismatched destinations: each raises
the documented error, names the file/tensor, and leaves the destination untouched."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from manifest_doc import file_of, row, set_file

import ckptd
from ckptd.manifest import layout as L
from ckptd.manifest.encode import encode_doc
from ckptd.manifest.parse import whole_doc
from ckptd.manifest.rows import AT


@pytest.fixture
def saved(tmp_path):
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root) as c:
        c.save({"model": {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(3)}, "step": 1})
        c.save(
            {
                "model": {"w": torch.arange(64.0).reshape(8, 8) * 2, "b": torch.ones(3) * 2},
                "step": 2,
            }
        )
    return root


def _dest():
    return {"model": {"w": torch.full((8, 8), -1.0), "b": torch.full((3,), -1.0)}, "step": -1}


def _untouched(dst) -> bool:
    return (
        torch.equal(dst["model"]["w"], torch.full((8, 8), -1.0))
        and torch.equal(dst["model"]["b"], torch.full((3,), -1.0))
        and dst["step"] == -1
    )


def _manifest(root, step=2):
    return os.path.join(root, L.manifest_path(step))


def _load(root, dst, step=2, strict=True):
    # read-only: these are the bytes on storage (with the node agent, a writer's load reads the
    # steps the agent holds in memory first)
    with ckptd.Checkpointer(root, read_only=True) as c:
        return c.load(dst, step=step, strict=strict)


def _rewrite_manifest(root, fn, step=2):
    """Tamper with a manifest and seal it again with a valid digest (an adversary can do that:
    the digest guards against damage, the validation against malice)."""
    with open(_manifest(root, step), "rb") as f:
        doc = whole_doc(f.read(), "test")
    fn(doc)
    with open(_manifest(root, step), "wb") as f:
        f.write(encode_doc(doc))


def test_missing_manifest_with_complete_partials_is_finalised_on_the_next_load(saved):
    os.unlink(_manifest(saved))
    dst = _dest()
    with ckptd.Checkpointer(saved) as c:
        assert c.load(dst).step == 2
    assert torch.equal(dst["model"]["w"], torch.arange(64.0).reshape(8, 8) * 2)
    assert os.path.exists(_manifest(saved))


def test_missing_manifest_is_not_a_checkpoint_and_latest_falls_back(saved):
    os.unlink(_manifest(saved))
    shutil.rmtree(os.path.join(saved, L.step_dir(2), "ranks"))
    dst = _dest()
    with pytest.raises(ckptd.CkptdError, match="no committed step 2"):
        _load(saved, dst)
    assert _untouched(dst)
    with ckptd.Checkpointer(saved) as c:
        assert c.load(dst).step == 1
    assert torch.equal(dst["model"]["w"], torch.arange(64.0).reshape(8, 8))


@pytest.mark.parametrize(
    "content", [b"", b'{"format": "ckptd", "vers', b"\x00\xff garbage", b"[1, 2, 3]"]
)
def test_truncated_or_garbage_manifest_is_corrupt(saved, content):
    with open(_manifest(saved), "wb") as f:
        f.write(content)
    dst = _dest()
    with pytest.raises(ckptd.CorruptCheckpoint, match="manifest.json"):
        _load(saved, dst)
    assert _untouched(dst)


def test_future_version_is_refused_with_a_clear_message(saved):
    _rewrite_manifest(saved, lambda d: d.update(version=99))
    dst = _dest()
    with pytest.raises(ckptd.CorruptCheckpoint, match=r"format version 99 is newer .*upgrade"):
        _load(saved, dst)
    assert _untouched(dst)


def test_flipped_byte_in_a_data_file_names_file_and_tensor(saved):
    with open(_manifest(saved)) as f:
        doc = json.load(f)
    chunk_file, offset = file_of(doc, row(doc, "model/w")), row(doc, "model/w")[AT["offset"]]
    path = os.path.join(saved, L.step_dir(2), chunk_file)
    with open(path, "r+b") as f:
        f.seek(offset + 17)
        byte = f.read(1)
        f.seek(offset + 17)
        f.write(bytes([byte[0] ^ 0x01]))
    dst = _dest()
    with pytest.raises(ckptd.CorruptCheckpoint) as err:
        _load(saved, dst)
    assert "model/w" in str(err.value) and chunk_file in str(err.value)
    assert "checksum mismatch" in str(err.value)
    assert _untouched(dst)


def test_truncated_data_file_is_corrupt(saved):
    with open(_manifest(saved)) as f:
        doc = json.load(f)
    path = os.path.join(saved, L.step_dir(2), file_of(doc, row(doc, "model/w")))
    os.truncate(path, row(doc, "model/w")[AT["offset"]] + 10)
    dst = _dest()
    with pytest.raises(ckptd.CorruptCheckpoint, match="model/w"):
        _load(saved, dst)
    assert _untouched(dst)


@pytest.mark.parametrize(
    "evil",
    ["../../../../etc/passwd", "/etc/passwd", "data/../../x.bin", "s3://other/bucket", "data/./x"],
)
def test_a_path_escaping_the_checkpoint_directory_is_refused(saved, evil):
    def poison(doc):
        set_file(doc, row(doc, "model/b"), evil)

    _rewrite_manifest(saved, poison)
    dst = _dest()
    with pytest.raises(ckptd.CorruptCheckpoint, match="model/b.*escapes the checkpoint directory"):
        _load(saved, dst)
    assert _untouched(dst)


def test_chunk_length_lying_about_its_box_is_corrupt(tmp_path):
    """Chunks of version 4 state their length (a row of version 5 has none: a reader derives
    it from the box): one that does not match its box is refused, naming the tensor."""
    root = str(tmp_path / "format4")
    shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "format4"), root)
    path = os.path.join(root, L.manifest_path(5))
    with open(path, "rb") as f:
        doc = whole_doc(f.read(), "test")
    doc["tensors"]["model/b"]["chunks"][0]["length"] = 4
    with open(path, "wb") as f:
        f.write(encode_doc(doc))
    dst = {"model": {"b": torch.full((4,), -1.0)}}
    with pytest.raises(ckptd.CorruptCheckpoint, match=r"manifest.json: model/b: malformed chunk "
                                                      r".*4 elements claims 4 bytes"):
        with ckptd.Checkpointer(root, read_only=True) as c:
            c.load(dst, strict=False)
    assert torch.equal(dst["model"]["b"], torch.full((4,), -1.0))


def test_destination_with_a_missing_key_is_a_mismatch(saved):
    dst = _dest()
    dst["model"]["extra"] = torch.full((2,), -1.0)
    with pytest.raises(ckptd.StateMismatch, match="model/extra: missing from the checkpoint"):
        _load(saved, dst)
    assert _untouched(dst)


def test_saved_tensor_nobody_asks_for_is_a_mismatch_when_strict_exact(saved):
    dst = _dest()
    del dst["model"]["b"]
    with pytest.raises(ckptd.StateMismatch, match="model/b: saved but not in the destination"):
        _load(saved, dst, strict="exact")
    assert torch.equal(dst["model"]["w"], torch.full((8, 8), -1.0))
    _load(saved, dst, strict=False)
    assert torch.equal(dst["model"]["w"], torch.arange(64.0).reshape(8, 8) * 2)


def test_wrong_shape_or_dtype_is_always_a_mismatch(saved):
    dst = _dest()
    dst["model"]["w"] = torch.full((8, 4), -1.0)
    with pytest.raises(
        ckptd.StateMismatch, match=r"model/w: saved shape \(8, 8\), destination \(8, 4\)"
    ):
        _load(saved, dst, strict=False)
    dst = _dest()
    dst["model"]["b"] = torch.full((3,), -1, dtype=torch.int64)
    with pytest.raises(ckptd.StateMismatch, match="model/b: saved dtype torch.float32"):
        _load(saved, dst, strict=False)
    assert torch.equal(dst["model"]["w"], torch.full((8, 8), -1.0))


def test_a_value_key_missing_from_the_checkpoint_is_a_mismatch(saved):
    dst = _dest()
    dst["epoch"] = 3
    with pytest.raises(ckptd.StateMismatch, match="epoch: value missing"):
        _load(saved, dst)
    assert _untouched(dst) and dst["epoch"] == 3


def test_non_json_leaves_are_refused_at_save(tmp_path):
    with ckptd.Checkpointer(str(tmp_path)) as c:
        with pytest.raises(ckptd.StateMismatch, match="sched: a object is neither"):
            c.save({"sched": object()})
