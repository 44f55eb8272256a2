"""A Hugging Face export that from_pretrained loads bit-exact, with transformers itself: the
names a ``torch.compile`` d model saves (``_orig_mod.``) are stripped, config.json is written,
only the model's tensors go out, and an export without config is refused."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import multirank
import pytest
import torch

import ckptd
from ckptd.cli import main

pytestmark = pytest.mark.slow
os.environ["HF_HUB_OFFLINE"] = "1"


def test_from_pretrained_of_a_compiled_llama_export_is_bit_exact_with_no_missing_keys(
        tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(compiled.parameters())
    compiled(torch.arange(8)[None]).logits.sum().backward()
    opt.step()
    sd = compiled.state_dict()
    assert all(k.startswith("_orig_mod.") for k in sd)
    with ckptd.Checkpointer(str(tmp_path / "root"), agent=False) as ck:
        ck.save({"model": sd, "optim": opt.state_dict(), "step": 1})
    config.save_pretrained(tmp_path / "base")
    out = tmp_path / "hf"
    base = ["export", str(tmp_path / "root"), "--format", "safetensors", "--out", str(out)]
    assert main(base) == 2
    assert "without config.json" in capsys.readouterr().err and not out.exists()
    assert main([*base, "--config-from", str(tmp_path / "base")]) == 0
    said = capsys.readouterr().out
    assert "+ config.json" in said and "removed wrapper segments" in said
    loaded, info = LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert (list(info["missing_keys"]), list(info["unexpected_keys"])) == ([], [])
    want = model.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert main(base + ["--config-from", str(tmp_path / "base")]) == 2  # not empty
    assert "--overwrite" in capsys.readouterr().err


def _tiny_llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=32, tie_word_embeddings=False)


def _fsdp2_compiled_llama_save(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """One training step of a torch.compile'd FSDP2 Llama on ``world`` gloo ranks, saved with
    ckptd (the model and optimizer as they are); returns the full model state (rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(compiled.parameters())
    compiled(torch.arange(8)[None]).logits.sum().backward()
    opt.step()
    with ckptd.Checkpointer(root, agent=False) as ck:
        ck.save({"model": compiled, "optim": opt, "step": 1})
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_from_pretrained_of_a_compiled_fsdp2_llama_export_is_bit_exact(tmp_path, capsys):
    """Saved on 2 FSDP2 ranks through torch.compile, exported with the config, loaded by
    from_pretrained on one process: every tensor bit-exact, no missing or unexpected key."""
    from transformers import LlamaForCausalLM

    root = str(tmp_path / "root")
    want = multirank.run(_fsdp2_compiled_llama_save, 2, root)[0]
    _tiny_llama_config().save_pretrained(tmp_path / "base")
    out = tmp_path / "hf"
    assert main(["export", root, "--format", "safetensors", "--out", str(out),
                 "--config-from", str(tmp_path / "base")]) == 0
    capsys.readouterr()
    loaded, info = LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert (list(info["missing_keys"]), list(info["unexpected_keys"])) == ([], [])
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _hf_blocks() -> list[str]:
    """The two blocks of docs/integrations.md's Hugging Face section: the command, the load."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    section = text[text.index("## Hugging Face"):]
    return re.findall(r"```text\n(.*?)```", section, re.S)[:2]


def test_the_documented_export_command_and_load_are_bit_exact(tmp_path, monkeypatch, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    command, load = _hf_blocks()
    monkeypatch.chdir(tmp_path)
    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    config.save_pretrained("base-model")
    with ckptd.Checkpointer("ckpts", agent=False) as ck:
        ck.save({"model": torch.compile(model, backend="eager").state_dict(), "step": 3})
    args = shlex.split(command.strip())
    assert args[0] == "ckptd" and main(args[1:]) == 0
    namespace: dict[str, object] = {}
    exec(compile(load, "<docs/integrations.md>", "exec"), namespace)
    loaded = namespace["model"]
    assert isinstance(loaded, LlamaForCausalLM)
    want, got = model.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
