"""The elastic metadata record, ``ckptd plan``, ``ckptd history --plot`` and the demo's phase
summary (fast: no processes)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd import elastic
from ckptd.cli import main
from ckptd.data import GlobalOrder
from ckptd.demo.timeline import DemoError, run_demo
from ckptd.elastic import preemption as preemption_module
from ckptd.elastic.events import render_phases, summarize
from ckptd.elastic.history import MAX_LOSS_POINTS, add_loss

PNG = b"\x89PNG\r\n\x1a\n"
SPEC5B = ["--hidden-size", "4096", "--num-layers", "28", "--num-params", "4832071680",
          "--zero-stage", "1", "--world", "480", "--micro-batch", "6", "--accum", "1",
          "--seq-len", "4096", "--mem-limit-gib", "120", "--max-micro-batch", "32"]


@pytest.fixture(autouse=True)
def clean_sigterm() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    preemption_module.uninstall()
    signal.signal(signal.SIGTERM, before)


@pytest.fixture
def elastic_ckpt(tmp_path: Path) -> str:
    """A root with one elastic run: 4 steps on 3 ranks, then 3 steps on 2 (re-planned)."""
    root = str(tmp_path / "run")
    model = elastic.ModelSpec(hidden_size=32, num_hidden_layers=2, num_parameters=20_000)
    reference = elastic.TrainingSpec(1, 3, 2, 2, 16)
    policy = elastic.ElasticPolicy(tolerance=0.1, mem_limit_gib=1.0, max_micro_batch_size=4,
                                   scale_up_cooldown_s=60.0)
    for world, steps in ((3, 4), (2, 3)):
        # in process whichever executor the suite runs: `ckptd history` below shows where the
        # restart read its bytes (storage, here)
        with ckptd.Checkpointer(root, rank=0, world_size=1, agent=False) as ckpt:
            run = elastic.resume(ckpt, reference=reference, model=model, policy=policy,
                                 world_size=world)
            state = {"w": torch.zeros(3)}
            run.load(state)
            run.check_data(GlobalOrder(40))  # a 40-sample dataset: epoch 1 from sample 40 on
            for _ in range(steps):
                run.step_done(loss=4.0 / (run.step + 1))
            run.save(state)
    return root


# --------------------------------------------------------------------------- the record


def test_the_metadata_is_plain_json_and_round_trips(elastic_ckpt: str) -> None:
    with ckptd.Checkpointer(elastic_ckpt, rank=0, world_size=1) as ckpt:
        training = ckpt.read_manifest(7).training
    meta = elastic.TrainingMeta.from_json(json.loads(json.dumps(training)))
    assert meta.to_json() == training
    assert training["version"] == 1
    assert set(training) == {"version", "spec", "reference", "model", "policy",
                             "consumed_samples", "history", "losses", "loss_stride",
                             "preempted_at", "data"}
    assert training["data"] == GlobalOrder(40).spec()
    assert [(e["step"], e["world_size"], e["reason"]) for e in training["history"]] == \
        [(0, 3, "start"), (4, 2, "scale-down")]
    assert training["consumed_samples"] == 7 * 12


@pytest.mark.parametrize("record, message", [
    ({}, "no elastic training metadata"),
    ({"spec": {}, "version": 2}, "version 2 is not supported"),
    ({"spec": {"version": 1}, "version": 1}, "malformed elastic metadata"),
])
def test_records_that_are_not_elastic_metadata_are_refused(record: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(elastic.NotElastic, match=message):
        elastic.TrainingMeta.from_json(record, "somewhere")


def test_the_loss_series_is_thinned_evenly_to_a_bounded_size() -> None:
    points: tuple[tuple[int, float], ...] = ()
    stride = 1
    for step in range(1, 10_001):
        points, stride = add_loss(points, stride, step, float(step))
    assert len(points) <= MAX_LOSS_POINTS and stride == 8
    assert [s for s, _ in points] == list(range(8, 10_001, 8))


def test_the_scale_up_wait_counts_from_the_newest_restart(elastic_ckpt: str) -> None:
    with ckptd.Checkpointer(elastic_ckpt, rank=0, world_size=1) as ckpt:
        meta = elastic.TrainingMeta.from_json(ckpt.read_manifest(7).training)
    last = meta.history[-1].time
    assert elastic.scale_up_wait_s(meta, last + 20) == pytest.approx(40.0)
    assert elastic.scale_up_wait_s(meta, last + 61) == 0.0
    assert elastic.scale_up_wait_s(meta, last, cooldown_s=5.0) == pytest.approx(5.0)
    stopped = dataclasses.replace(meta, preempted_at=last + 10)  # a preemption save is newest
    assert elastic.scale_up_wait_s(stopped, last + 20) == 0.0


# --------------------------------------------------------------------------- ckptd plan


def test_plan_prints_the_documented_rows_as_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *SPEC5B, "--to-world", "408,480,800"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| world | micro | accum | ZeRO | global batch | deviation % |")
    assert lines[2] == "| 408 | 1 | 7 | 1 | 2856 | -0.83 | 27.090 | 14.000 | 41.090 |  |"
    assert lines[3] == "| 480 | 6 | 1 | 1 | 2880 | +0.00 | 27.076 | 84.000 | 111.076 |  |"
    assert lines[4].startswith("| 800 | — | — |")
    assert "or world size 792 (leave 8 ranks idle)" in lines[4]


def test_plan_json_has_one_object_per_world(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *SPEC5B, "--to-world", "8..24:8", "--json", "--tolerance", "5%"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["world"] for r in rows] == [8, 16, 24]
    assert [(r["micro"], r["accum"], r["global_batch"]) for r in rows] == \
        [(6, 60, 2880), (6, 30, 2880), (6, 20, 2880)]


def test_plan_takes_the_model_and_reference_from_a_checkpoint(
        elastic_ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--from", elastic_ckpt, "--to-world", "2..4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["world"], r["micro"], r["accum"], r["global_batch"]) for r in rows] == \
        [(2, 3, 2, 12), (3, 4, 1, 12), (4, 3, 1, 12)]


def test_plan_without_a_model_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--to-world", "4", "--world", "2"]) == 2
    assert "without --from, give all of --zero-stage" in capsys.readouterr().err


# --------------------------------------------------------------------------- ckptd history


def test_history_prints_the_churn_and_writes_a_png(
        elastic_ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "history.png"
    assert main(["history", elastic_ckpt, "--plot", str(out)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == ("step 7, 84 samples consumed; reference global batch 12 on 3 ranks, "
                       "tolerance ±10%")
    assert text[1].split()[10:12] == ["consumed", "epoch"]
    assert text[3].split() == ["0", "start", "3", "2", "2", "1", "12", "+0.00", "0", "0", "—",
                               "—", "—", "—"]
    assert text[4].split()[:10] == ["4", "scale-down", "2", "3", "2", "1", "12", "+0.00", "48",
                                    "1"]
    # no node agent: the restart read every byte from storage
    assert " 0 B / 0 B / " in text[4] and " 0 B / 0 B / 0 B " not in text[4]
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000


def test_history_json_of_one_step(elastic_ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", f"{elastic_ckpt}/step-000000004", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 4 and len(doc["history"]) == 1


def test_history_of_a_checkpoint_without_elastic_metadata_shows_its_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "plain")
    with ckptd.Checkpointer(root, rank=0, world_size=1) as ckpt:
        ckpt.save({"w": torch.ones(1 << 10)}, step=3)
        ckpt.save({"w": torch.ones(1 << 10)}, step=5)
    assert main(["history", root]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"committed steps under {root}:"
    assert [line.split()[:3] for line in out[3:5]] == [["3", "1", "4.0"], ["5", "1", "4.0"]]
    assert "step 5 has no elastic training metadata" in out[-1]
    assert main(["history", root, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["world_size"], r["nbytes"]) for r in doc["steps"]] == [
        (3, 1, 4096), (5, 1, 4096)]
    assert doc["elastic"] is None
    assert main(["history", root, "--plot", str(tmp_path / "x.png")]) == 2
    assert "no elastic metadata" in capsys.readouterr().err


# --------------------------------------------------------------------------- the demo


def _ev(ev: str, t: float, rank: int = 0, **kw: Any) -> dict[str, Any]:
    return {"ev": ev, "t": t, "rank": rank, **kw}


def test_the_demo_summary_splits_phases_at_each_resume() -> None:
    spec3 = {"zero_stage": 1, "world_size": 3, "micro_batch_size": 1,
             "gradient_accumulation_steps": 4}
    spec2 = {"zero_stage": 2, "world_size": 2, "micro_batch_size": 1,
             "gradient_accumulation_steps": 6}
    events = [
        _ev("resume", 0.0, step=0, world=3, reason="start", training=spec3),
        _ev("step", 1.0, step=1, world=3), _ev("save", 1.1, step=1, stall_s=0.002),
        _ev("save", 1.1, rank=1, step=1, stall_s=0.004), _ev("step", 2.0, step=2, world=3),
        _ev("sigterm", 2.5, rank=1, step=2), _ev("preempt", 2.7, rank=1, step=2,
                                                   signalled=True, signal_to_committed_s=0.2),
        _ev("preempt", 2.7, step=2, signalled=False, signal_to_committed_s=0.21),
        _ev("resume", 10.0, step=2, world=2, reason="scale-down", training=spec2),
        _ev("loaded", 10.2, step=2, load_s=0.15, from_memory=3072, from_peer=0,
            from_storage=1024),
        _ev("loaded", 10.2, rank=1, step=2, load_s=0.1, from_memory=1024, from_peer=2048,
            from_storage=0),
        _ev("training", 10.5, step=3, world=2),
        _ev("step", 10.5, step=3, world=2), _ev("step", 11.0, step=4, world=2),
        _ev("node_lost", 11.2, rank=-1, node="b"),
        _ev("resume", 15.0, step=4, world=1, reason="scale-down", training=spec2),
        _ev("training", 16.0, step=5, world=1), _ev("done", 17.0, step=5),
    ]
    first, second, third = summarize(events)
    assert (first.world, first.first_step, first.last_step, first.saves) == (3, 0, 2, 1)
    assert (first.stall_median_s, first.stall_max_s) == (0.004, 0.004)
    assert (first.ended_by, first.sigterm_to_committed_s, first.downtime_s) == ("sigterm", 0.2,
                                                                                 8.0)
    assert (second.world, second.reason, second.load_s) == (2, "scale-down", 0.15)
    assert second.bytes_from == (4096, 2048, 1024)  # over both ranks
    assert (second.ended_by, second.downtime_s) == ("node lost", 16.0 - 11.2)
    assert (third.ended_by, third.bytes_from) == ("done", None)
    table = render_phases([first, second, third])
    assert "| 2 (scale-down) | 2 | 3–4 | 1 × 6 | 2 | 12 |" in table  # the steps it trained
    assert "| 3 (scale-down) | 1 | none |" in table  # no step event came before "done"
    assert "| 0.15 s | 4 / 2 / 1 | node lost |" in table


def test_the_demo_refuses_a_directory_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "old").write_text("x")
    with pytest.raises(DemoError, match="is not empty"):
        run_demo(tmp_path)


def test_join_waits_out_the_cooldown_then_becomes_the_command(elastic_ckpt: str) -> None:
    join = Path(__file__).resolve().parent.parent / "integrations" / "torchrun" / "join.py"
    with ckptd.Checkpointer(elastic_ckpt, rank=0, world_size=1) as ckpt:
        last = elastic.TrainingMeta.from_json(ckpt.read_manifest(7).training).history[-1].time
    # the last restart was 12 s short of the cooldown: longer than the child's start-up (torch
    # import) on a loaded 2-core machine, so the child always still has to wait
    cooldown = time.time() - last + 12.0

    def run(cooldown_s: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(join), "--ckpt", elastic_ckpt, "--cooldown-s", str(cooldown_s),
             "--", sys.executable, "-c", "print('joined')"],
            capture_output=True, text=True, timeout=60)

    t0 = time.time()
    done = run(cooldown)
    assert (done.returncode, done.stdout) == (0, "joined\n"), done.stderr
    assert "the run restarted less than its cooldown ago; waiting" in done.stderr
    assert time.time() >= last + cooldown and time.time() - t0 < 45
    done = run(0.0)
    assert (done.returncode, done.stdout, done.stderr) == (0, "joined\n", "")
