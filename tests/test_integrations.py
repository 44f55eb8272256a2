"""The runnable integrations under ``integrations/`` run, and docs/integrations.md shows them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import ckptd
from ckptd.manifest import layout as L

ROOT = Path(__file__).resolve().parent.parent


def run_example(path: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / path), *args], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"{path} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def manifest(root: Path) -> ckptd.manifest.Manifest:
    with ckptd.Checkpointer(str(root), rank=0, world_size=1, keep_last=0) as ck:
        step = ck.latest_step()
        assert step is not None
        return ck.read_manifest(step)


def test_fsdp2_example_saves_async_on_four_ranks_and_resumes_on_two_with_adam_state(tmp_path):
    out = run_example("integrations/fsdp2/train.py", "--root", str(tmp_path))
    resumed = re.search(
        r"resumed step 4 on 2 ranks from a checkpoint of 4 ranks: state (\w+), saved (\w+)", out
    )
    assert resumed is not None, out
    assert resumed.group(1) == resumed.group(2)  # model + Adam state, full tensors, bit-exact
    losses = [float(x) for x in re.findall(r"step \d on \d ranks: loss ([\d.]+)", out)]
    assert len(losses) == 7 and losses[-1] < losses[0]
    m = manifest(tmp_path)
    assert (m.step, m.world_size) == (6, 2)
    assert {
        "model/blocks.0.up.weight",
        "optim/state/blocks.0.up.weight/exp_avg",
        "optim/state/blocks.0.up.weight/exp_avg_sq",
    } <= set(m.tensors)


@pytest.mark.slow
def test_fsdp2_model_and_optimizer_passed_as_objects_save_on_two_ranks_resume_on_three(tmp_path):
    out = run_example("integrations/fsdp2/train.py", "--root", str(tmp_path),
                      "--save-world", "2", "--resume-world", "3")
    resumed = re.search(
        r"resumed step 4 on 3 ranks from a checkpoint of 2 ranks: state (\w+), saved (\w+)", out
    )
    assert resumed is not None, out
    assert resumed.group(1) == resumed.group(2)  # model + Adam state, full tensors, bit-exact
    m = manifest(tmp_path)
    assert (m.step, m.world_size) == (6, 3)
    assert "optim/state/blocks.1.down.weight/exp_avg_sq" in m.tensors  # by name, not index


def test_flat_buffer_example_resumes_on_another_dp_tp_pp_layout_bit_exact(tmp_path):
    out = run_example("integrations/flat_buffer/train.py", "--root", str(tmp_path), "--verify")
    assert "resumed step 4 on dp1.tp3.pp1 (3 ranks)" in out
    assert (
        "verified: 4 steps on dp2.tp1.pp2, save, 4 on dp1.tp3.pp1 == 8 steps on "
        "dp2.tp1.pp2, bit for bit (45 logical tensors)"
    ) in out
    m = manifest(tmp_path / "run")
    assert (m.step, m.world_size) == (8, 3)
    assert "model/layers.3.up.weight" in m.tensors and m.tensors["model/embed.weight"].shape == (
        30,
        12,
    )
    assert not any("flat" in name for name in m.tensors)  # logical tensors, not buffers
    assert (tmp_path / "run" / L.step_dir(4) / L.MANIFEST).exists()  # the 4-rank save


def test_ckptd_does_not_import_integrations():
    pattern = re.compile(r"^\s*(from|import)\s+integrations\b", re.M)
    offenders = [str(p) for p in (ROOT / "ckptd").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(language, lines)`` of every fenced block."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks.append((lang, lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def test_docs_show_each_integration_in_under_30_lines_taken_from_the_examples():
    text = (ROOT / "docs" / "integrations.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) == 7
    for section in sections:
        blocks = [lines for _, lines in fenced_blocks(section) if len(lines) > 1]
        assert len(blocks) == 1 and len(blocks[0]) < 30, section.splitlines()[0]
        source = re.search(r"\(`(integrations/[\w/]+\.py)`\)", section.splitlines()[0])
        if source is None:  # a single-process example: tests/test_docs.py runs it
            continue
        example = (ROOT / source.group(1)).read_text()
        missing = [
            line
            for line in blocks[0]
            if line.strip() and line.strip() != "..." and line.strip() not in example
        ]
        assert missing == [], f"{source.group(1)} no longer has: {missing}"
