"""The restart flow in one process: planning, data position, history, and the preemption save.

GroupStore are real (``os.kill`` of this process); when a save must be in flight at the moment the
SIGTERM arrives, its data writes wait on a gate that the SIGTERM callback itself opens, so the
ordering is guaranteed without timing anything.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd import elastic
from ckptd.elastic import preemption as preemption_module
from ckptd.storage.local import LocalStorage

MODEL = elastic.ModelSpec(hidden_size=32, num_hidden_layers=2, num_parameters=20_000)
REFERENCE = elastic.TrainingSpec(zero_stage=1, world_size=3, micro_batch_size=2,
                                 gradient_accumulation_steps=2, sequence_length=16)
POLICY = elastic.ElasticPolicy(tolerance=0.0, mem_limit_gib=1.0, max_micro_batch_size=4)
MEMBERS = [("w", (2, 3)), ("b", (3,))]


class GatedStorage(LocalStorage):
    """Data-file writes wait until ``gate`` is set (a save stays in flight until then)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    def write_file(self, path: str, parts: Iterable[Any], gate=None) -> int:
        if not self.gate.wait(timeout=60):
            raise TimeoutError("gate never opened")
        return super().write_file(path, parts, gate)


@pytest.fixture(autouse=True)
def _sigterm_restored(clean_sigterm: None) -> None:
    """Every test here may install the preemption handler (conftest's clean_sigterm)."""


@pytest.fixture
def checkpointers() -> Iterator[list[ckptd.Checkpointer]]:
    opened: list[ckptd.Checkpointer] = []
    yield opened
    for c in opened:
        c.close()


def open_ckpt(root: Path, opened: list[ckptd.Checkpointer], **kw: Any) -> ckptd.Checkpointer:
    c = ckptd.Checkpointer(str(root), rank=0, world_size=1, **kw)
    opened.append(c)
    return c


def flat_state() -> tuple[torch.Tensor, dict[str, Any]]:
    buf = torch.zeros(10)  # 9 elements of members, 1 of padding
    return buf, {"model": {"flat": ckptd.FlatShard(buf, MEMBERS, 0)}}


def train(run: elastic.ElasticRun, buf: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        buf[:9] += 1
        run.step_done(loss=1.0 / (run.step + 1))


def new_run(ckpt: ckptd.Checkpointer, world: int, tmp_path: Path, **kw: Any) -> elastic.ElasticRun:
    return elastic.resume(ckpt, reference=REFERENCE, model=MODEL, policy=POLICY,
                          world_size=world, dp_rank=0, events=str(tmp_path / "events.jsonl"),
                          **kw)


def events(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["ev"] == kind]


# --------------------------------------------------------------------------- planning


def test_a_fresh_start_keeps_the_reference_on_its_world_and_replans_on_another(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    run = new_run(open_ckpt(tmp_path / "a", checkpointers), 3, tmp_path)
    assert run.training == REFERENCE
    assert (run.step, run.consumed_samples, run.resumed_step) == (0, 0, None)
    assert run.entry.reason == "start"
    run = new_run(open_ckpt(tmp_path / "b", checkpointers), 2, tmp_path)
    t = run.training
    assert (t.world_size, t.micro_batch_size, t.gradient_accumulation_steps) == (2, 3, 2)
    assert t.global_batch_size == REFERENCE.global_batch_size


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_sample_indices_cover_every_step_exactly_once_whatever_the_world(
        world: int, tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    run = new_run(open_ckpt(tmp_path / "r", checkpointers), world, tmp_path)
    t = run.training
    seen: list[int] = []
    for _ in range(3):
        before = run.consumed_samples
        step = [i for r in range(t.world_size) for m in range(t.gradient_accumulation_steps)
                for i in run.sample_indices(m, r)]
        assert sorted(step) == list(range(before, before + t.global_batch_size))
        seen += step
        run.step_done()
    assert sorted(seen) == list(range(3 * t.global_batch_size))
    with pytest.raises(elastic.InvalidSpec, match="outside"):
        run.sample_indices(t.gradient_accumulation_steps)


def test_restarts_replan_from_the_reference_and_append_the_history(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    root = tmp_path / "ckpt"
    batch = REFERENCE.global_batch_size
    # world 3 (the reference) -> 2 -> 4 -> 4 -> 3: each incarnation trains 5 steps and saves
    worlds = [3, 2, 4, 4, 3]
    for i, world in enumerate(worlds):
        ckpt = open_ckpt(root, checkpointers)
        run = new_run(ckpt, world, tmp_path)
        buf, state = flat_state()
        loaded = run.load(state)
        assert (loaded is None) == (i == 0)
        assert run.step == 5 * i and run.consumed_samples == 5 * i * batch
        assert torch.equal(buf[:9], torch.full((9,), 5.0 * i))
        train(run, buf, 5)
        run.save(state)
        ckpt.close()
    meta = elastic.TrainingMeta.from_json(open_ckpt(root, checkpointers).read_manifest(25).training)
    assert [e.reason for e in meta.history] == ["start", "scale-down", "scale-up", "restart",
                                                "scale-down"]
    assert [e.world_size for e in meta.history] == worlds
    assert [e.step for e in meta.history] == [0, 5, 10, 15, 20]
    assert [e.consumed_samples for e in meta.history] == [0, 60, 120, 180, 240]
    assert all(e.global_batch_size == batch and e.deviation == 0.0 for e in meta.history)
    assert meta.history[-1].micro_batch_size == REFERENCE.micro_batch_size  # no drift
    assert meta.spec == REFERENCE and meta.reference == REFERENCE
    assert meta.consumed_samples == 25 * batch
    assert [s for s, _ in meta.losses] == list(range(1, 26))
    assert all(e.load_s is not None and e.load_s >= 0 for e in meta.history[1:])


def test_an_unchanged_world_keeps_the_previous_settings_even_if_the_planner_differs(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    ckpt = open_ckpt(tmp_path / "c", checkpointers)
    reference = elastic.TrainingSpec(1, 6, 1, 2, 16)  # global batch 12
    small = elastic.ElasticPolicy(tolerance=0.0, mem_limit_gib=1.0, max_micro_batch_size=2)
    run = elastic.resume(ckpt, reference=reference, model=MODEL, policy=small, world_size=3)
    assert run.training == elastic.TrainingSpec(1, 3, 2, 2, 16)
    buf, state = flat_state()
    train(run, buf, 1)
    run.save(state)
    # a restart on 3 ranks under a policy that would now plan 4 x 1 keeps 2 x 2 (bit-identical
    # continuation); only a change of world size re-plans
    run = elastic.resume(ckpt, reference=reference, model=MODEL, policy=POLICY, world_size=3)
    assert run.training == elastic.TrainingSpec(1, 3, 2, 2, 16)
    assert run.entry.reason == "restart"
    assert elastic.replan(MODEL, reference, 3, **POLICY.replan_kwargs()).training == \
        elastic.TrainingSpec(1, 3, 4, 1, 16)


def test_a_checkpoint_without_elastic_metadata_is_refused_with_its_step(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    ckpt = open_ckpt(tmp_path / "plain", checkpointers)
    ckpt.save({"w": torch.ones(2)}, step=7)
    with pytest.raises(elastic.NotElastic, match="step 7: no elastic training metadata"):
        new_run(ckpt, 3, tmp_path)


# --------------------------------------------------------------------------- preemption


def test_sigterm_during_an_in_flight_async_save_drains_it_then_commits_the_current_step(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    storage = GatedStorage(str(tmp_path / "ckpt"))
    ckpt = open_ckpt(tmp_path / "ckpt", checkpointers, storage=storage)
    run = new_run(ckpt, 3, tmp_path, on_sigterm=storage.gate.set)
    buf, state = flat_state()
    train(run, buf, 2)
    handle = run.save_async(state)  # staged; its write waits on the gate
    train(run, buf, 1)
    assert handle.phase is ckptd.writer.handle.Phase.STAGED
    os.kill(os.getpid(), signal.SIGTERM)  # the callback opens the gate
    assert ckptd.preempted()
    out = run.save_on_preemption(state)
    assert events(tmp_path, "sigterm")[0]["save_phase"] == "staged"
    assert (out.saved, out.reason, out.exit_code, out.signalled) == (True, "committed", 0, True)
    assert out.signal_to_committed_s is not None and 0 < out.signal_to_committed_s < 30
    assert ckpt.latest_step() == 3 and handle.result().step == 2
    meta = elastic.TrainingMeta.from_json(ckpt.read_manifest(3).training)
    assert meta.preempted_at is not None and meta.consumed_samples == 36


def test_sigterm_during_staging_waits_for_the_staging_and_commits(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    storage = GatedStorage(str(tmp_path / "ckpt"))
    ckpt = open_ckpt(tmp_path / "ckpt", checkpointers, storage=storage, max_inflight=2)
    run = new_run(ckpt, 3, tmp_path, on_sigterm=storage.gate.set)
    buf, state = flat_state()
    train(run, buf, 1)
    first = run.save_async(state)  # holds the save thread: its write waits on the gate
    train(run, buf, 1)
    second = run.save_async(state, overlap=True)  # staged by that thread, after the first
    assert second.phase is ckptd.writer.handle.Phase.STAGING
    os.kill(os.getpid(), signal.SIGTERM)
    second.wait_staged()  # what the loop does before the optimizer step
    train(run, buf, 1)
    assert ckptd.preempted()
    out = run.save_on_preemption(state)
    assert events(tmp_path, "sigterm")[0]["save_phase"] == "staging"
    assert (out.saved, out.exit_code) == (True, 0)
    assert (first.result().step, second.result().step, ckpt.latest_step()) == (1, 2, 3)
    loaded_buf, loaded = flat_state()
    ckpt.load(loaded, step=2)
    assert torch.equal(loaded_buf[:9], torch.full((9,), 2.0))  # the values at the call


def test_a_step_already_committed_is_not_saved_again(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    ckpt = open_ckpt(tmp_path / "ckpt", checkpointers)
    run = new_run(ckpt, 3, tmp_path)
    buf, state = flat_state()
    train(run, buf, 2)
    run.save_async(state)
    os.kill(os.getpid(), signal.SIGTERM)
    assert ckptd.preempted()
    out = run.save_on_preemption(state)
    assert (out.saved, out.reason, out.nbytes, out.exit_code) == (True, "already committed", 0, 0)
    assert ckpt.latest_step() == 2


def test_a_save_that_cannot_finish_in_the_grace_left_is_skipped_and_latest_stays(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer],
        caplog: pytest.LogCaptureFixture) -> None:
    ckpt = open_ckpt(tmp_path / "ckpt", checkpointers)
    policy = elastic.ElasticPolicy(tolerance=0.0, mem_limit_gib=1.0, max_micro_batch_size=4,
                                   assumed_write_bytes_per_s=1.0)  # 36 bytes: 36 s
    run = elastic.resume(ckpt, reference=REFERENCE, model=MODEL, policy=policy, world_size=3,
                         grace_s=30.0)
    buf, state = flat_state()
    train(run, buf, 1)
    run.save(state)  # committed step 1, and a measured bandwidth ...
    run._saves.bandwidth = None  # ... forgotten: the assumed 1 B/s applies
    train(run, buf, 1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert ckptd.preempted()
    with caplog.at_level(logging.WARNING, logger="ckptd.elastic"):
        out = run.save_on_preemption(state)
    assert not out.saved and out.exit_code == 0
    assert out.projected_s == pytest.approx(36.0)
    assert "projected 36.0s (36 bytes at 0 MB/s) exceeds the" in out.reason
    assert "step 1 stays latest" in caplog.text
    assert ckpt.latest_step() == 1


def test_a_rank_that_was_not_signalled_exits_with_the_restart_code(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    run = new_run(open_ckpt(tmp_path / "ckpt", checkpointers), 3, tmp_path)
    buf, state = flat_state()
    train(run, buf, 1)
    out = run.save_on_preemption(state)  # no SIGTERM reached this rank
    assert (out.saved, out.signalled, out.exit_code) == (True, False, elastic.EXIT_RESTART)


def test_a_preemption_save_takes_a_model_and_its_optimizer_as_they_are(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    ckpt = open_ckpt(tmp_path / "ckpt", checkpointers)
    run = new_run(ckpt, 3, tmp_path)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    run.step_done()
    out = run.save_on_preemption({"model": model, "optim": opt})
    assert out.saved and out.nbytes > 0, out.reason
    assert "optim/state/weight/exp_avg" in ckpt.read_manifest(ckpt.latest_step()).tensors


class SignallingStorage(LocalStorage):
    """Once ``armed``, the first data-file write sends SIGTERM to this process: the signal
    arrives while a save is being written."""

    armed = False

    def write_file(self, path: str, parts: Iterable[Any], gate=None) -> int:
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGTERM)
        return super().write_file(path, parts, gate)


def test_a_sigterm_that_arrives_during_the_preemption_save_makes_the_rank_exit_0(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    # torchrun signals a node's workers one after another: this rank agreed to save before its
    # own SIGTERM arrived (another rank's did); its node is going away all the same
    storage = SignallingStorage(str(tmp_path / "ckpt"))
    run = new_run(open_ckpt(tmp_path / "ckpt", checkpointers, storage=storage), 3, tmp_path)
    buf, state = flat_state()
    train(run, buf, 1)
    storage.armed = True
    out = run.save_on_preemption(state)
    assert events(tmp_path, "preempting")[-1]["signalled"] is False
    assert events(tmp_path, "sigterm")  # it arrived during the save
    assert (out.saved, out.signalled, out.exit_code) == (True, True, 0)


def test_the_next_incarnation_records_its_downtime_from_the_sigterm(
        tmp_path: Path, checkpointers: list[ckptd.Checkpointer]) -> None:
    ckpt = open_ckpt(tmp_path / "ckpt", checkpointers)
    run = new_run(ckpt, 3, tmp_path)
    buf, state = flat_state()
    train(run, buf, 1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert ckptd.preempted()
    assert run.save_on_preemption(state).saved
    preemption_module.uninstall()
    run = new_run(ckpt, 2, tmp_path)
    assert run.entry.safe_via == "storage"  # the preemption save was written in the grace
    run.load(state)
    assert run.entry.downtime_s is None
    train(run, buf, 1)
    assert run.entry.downtime_s is not None and 0 < run.entry.downtime_s < 30
    assert events(tmp_path, "training")[-1]["downtime_s"] == run.entry.downtime_s
    assert run.metadata()["preempted_at"] is None  # this incarnation was not preempted
