"""Elastic training for real: ``integrations/torchrun/train.py`` under torchrun agents (or plain
worker processes) on 127.0.0.1, preempted with real signals.

Every wait is on the workers' event lines (``--events``), bounded; the final models are read
back from the checkpoints with ckptd itself (a one-rank ZeRO-0 layout, whatever the layout that
saved them). Slow: run with ``pytest -m slow``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from agent_procs import alive

import ckptd
from ckptd.cli import main
from ckptd.cli.elastic import read_meta
from ckptd.data import GlobalOrder
from ckptd.demo.cluster import Cluster, _descendants, step_reached

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "integrations" / "torchrun" / "train.py"

pytestmark = pytest.mark.slow
TIMEOUT_S = 90.0
BATCH = 12
# The reference: 3 ranks x micro-batch 2 x accumulation 2; with tolerance 0 every world keeps
# the global batch at exactly 12 (2 ranks: 3 x 2).
ARGS = ["--ref-world", "3", "--micro-batch", "2", "--accum", "2", "--zero-stage", "1",
        "--tolerance", "0", "--max-micro-batch", "4", "--mem-limit-gib", "1", "--save-every", "10"]
# Elastic and uninterrupted runs differ only by float summation order (other world sizes reduce
# gradients in other orders); measured max |difference| after 287 Adam steps: 3.8e-7.
PARAM_ATOL = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Workers:
    """``world`` worker processes joined by env:// on 127.0.0.1 (no torchrun agent)."""

    def __init__(self, workdir: Path, world: int, args: list[str]) -> None:
        self.events = workdir / "events.jsonl"
        port = free_port()
        self.procs = []
        for rank in range(world):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                   "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
            log = open(workdir / f"worker-{rank}.log", "ab")  # noqa: SIM115 - closed by the child
            self.procs.append(subprocess.Popen(
                [sys.executable, str(TRAIN), *args, "--events", str(self.events)], env=env,
                stdout=log, stderr=subprocess.STDOUT))
            log.close()
        self.workdir = workdir

    def wait_for(self, what: str, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            for ev in read_events(self.events):
                if predicate(ev):
                    return ev
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.05)
        raise AssertionError(f"no event for {what}; exit codes {self.wait(0.1)}\n{self.logs()}")

    def wait(self, timeout: float = TIMEOUT_S) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def logs(self) -> str:
        return "\n".join(f.read_text(errors="replace")[-3000:]
                         for f in sorted(self.workdir.glob("worker-*.log")))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def workers() -> Iterator[list[Workers]]:
    started: list[Workers] = []
    yield started
    for w in started:
        w.kill()


def final_model(root: Path, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """The parameters and Adam moments of a checkpoint, loaded into one rank's ZeRO-0 buffers."""
    if str(TRAIN.parent) not in sys.path:  # the trainer's modules, only when these tests run
        sys.path.append(str(TRAIN.parent))
    from model import Config, param_specs
    from zero import FlatZero

    zero = FlatZero(param_specs(Config()), stage=0, dp_size=1, dp_rank=0)
    state = zero.state()
    with ckptd.Checkpointer(str(root), rank=0, world_size=1, run_id="reader",
                           read_only=True) as ckpt:
        result = ckpt.load(state, step=step)
    n = zero.numel
    return result.step, {"params": zero.params[:n].clone(), "exp_avg": zero.exp_avg[:n].clone(),
                         "exp_avg_sq": zero.exp_avg_sq[:n].clone()}


def steps_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["ev"] == "step"]


def test_three_agents_lose_one_then_gain_one_and_match_an_uninterrupted_run(
        tmp_path: Path, workers: list[Workers]) -> None:
    elastic_dir, ref_dir = tmp_path / "elastic", tmp_path / "reference"
    elastic_dir.mkdir()
    ref_dir.mkdir()
    stop = elastic_dir / "STOP"
    samples_dir = elastic_dir / "samples"
    samples_dir.mkdir()
    args = ["--ckpt", str(elastic_dir / "ckpt"), "--steps", "100000", "--stop-file", str(stop),
            "--sample-log", str(samples_dir), *ARGS]
    # MAX = 3: the rounds of 3 close as soon as the third agent joins; the round of 2 closes
    # after a last call long enough for both survivors' 1 s rendezvous polls under CI load
    with Cluster(elastic_dir, args, script=TRAIN, max_nodes=3, last_call_s=5) as cluster:
        cluster.start_store()
        for _ in range(3):
            cluster.add_node()

        def trained(world: int, steps: int, after: float) -> None:
            first = cluster.wait_for(f"world {world}", step_reached(world, 0), TIMEOUT_S,
                                     after=after)
            cluster.wait_for(f"{steps} steps on {world}",
                             step_reached(world, first["step"] + steps), TIMEOUT_S)

        trained(3, 25, 0.0)
        t_term = cluster.preempt(cluster.nodes[1])
        trained(2, 25, t_term)
        t_join = time.time()
        cluster.add_node()
        trained(3, 25, t_join)
        stop.touch()
        done = cluster.wait_for("done", lambda e: e["ev"] == "done", TIMEOUT_S)
        codes = cluster.wait_exit(TIMEOUT_S)
        events = cluster.events()
    assert {k: v for k, v in codes.items() if k != "b"} == {"a": 0, "c": 0, "d": 0}
    final = done["step"]

    # the run went 3 -> 2 -> 3 and every step was trained exactly once, on consecutive samples
    resumes = [e for e in events if e["ev"] == "resume" and e["rank"] == 0]
    assert [(e["reason"], e["world"]) for e in resumes] == [("start", 3), ("scale-down", 2),
                                                            ("scale-up", 3)]
    steps = steps_of(events)
    assert [e["step"] for e in steps] == list(range(1, final + 1))
    assert all(e["consumed"] == e["step"] * BATCH and e["global_batch"] == BATCH for e in steps)
    # ... and the DataLoaders read the global order's prefix, each sample exactly once per
    # epoch: no duplicate, no gap, through 3 -> 2 -> 3 (the dataset is 1000 samples)
    logged = [json.loads(line) for f in samples_dir.iterdir() for line in f.read_text().splitlines()
              if line]
    per_step: dict[int, list[int]] = {}
    for rec in logged:
        per_step.setdefault(rec["step"], []).extend(rec["samples"])
    assert sorted(per_step) == list(range(1, final + 1))
    order = GlobalOrder(1000, seed=0)
    for s, got in per_step.items():
        want = [order.index(p) for p in range((s - 1) * BATCH, s * BATCH)]
        assert sorted(got) == sorted(want), f"step {s}: read {sorted(got)}, expected {want}"
    preempts = [e for e in events if e["ev"] == "preempt"]
    assert preempts and all(e["saved"] for e in preempts)
    step, elastic_model = final_model(elastic_dir / "ckpt")
    assert step == final

    # the same global batch, never interrupted, on 3 ranks
    ref = Workers(ref_dir, 3, ["--ckpt", str(ref_dir / "ckpt"), "--steps", str(final), *ARGS])
    workers.append(ref)
    assert ref.wait() == [0, 0, 0], ref.logs()
    _, ref_model = final_model(ref_dir / "ckpt")
    for key in ref_model:
        diff = (elastic_model[key] - ref_model[key]).abs().max().item()
        print(f"{key}: max |elastic - uninterrupted| = {diff:.2e} after {final} steps")
        assert diff <= PARAM_ATOL, f"{key}: max |elastic - uninterrupted| = {diff}"
    ref_losses = {e["step"]: e["loss"] for e in steps_of(read_events(ref.events))}
    assert max(abs(e["loss"] - ref_losses[e["step"]]) for e in steps) < 1e-4


def test_a_restart_at_the_same_world_size_is_bit_identical(tmp_path: Path,
                                                           workers: list[Workers]) -> None:
    run_dir, ref_dir = tmp_path / "run", tmp_path / "reference"
    run_dir.mkdir()
    ref_dir.mkdir()
    args = ["--ckpt", str(run_dir / "ckpt"), "--steps", "60", *ARGS, "--ref-world", "2",
            "--micro-batch", "3"]
    ref = Workers(ref_dir, 2, [*args[:1], str(ref_dir / "ckpt"), *args[2:]])
    workers.append(ref)
    with Cluster(run_dir, args, script=TRAIN, nproc_per_node=2) as cluster:  # one node, 2 ranks
        node = cluster.add_node()
        cluster.wait_for("step 25", step_reached(2, 25), TIMEOUT_S)
        t_term = cluster.preempt(node)  # the whole job is preempted (a batch-system requeue)
        cluster.wait_exit(TIMEOUT_S)
        saved = [e for e in cluster.events() if e["ev"] == "preempt" and e["t"] >= t_term]
        assert len(saved) == 2 and all(e["saved"] and e["exit_code"] == 0 for e in saved)
        resumed_at = saved[0]["step"]
        cluster.add_node("requeued")
        cluster.wait_for("done", lambda e: e["ev"] == "done" and e["rank"] == 0, TIMEOUT_S)
        assert cluster.wait_exit(TIMEOUT_S)["requeued"] == 0
        events = cluster.events()
    assert ref.wait() == [0, 0], ref.logs()
    assert [e["step"] for e in events if e["ev"] == "resume" and e["rank"] == 0] == \
        [0, resumed_at]
    assert [e["step"] for e in steps_of(events)] == list(range(1, 61))
    _, run_model = final_model(run_dir / "ckpt", 60)
    _, ref_model = final_model(ref_dir / "ckpt", 60)
    for key in ref_model:
        assert torch.equal(run_model[key], ref_model[key]), key
    ref_losses = [e["loss"] for e in steps_of(read_events(ref.events))]
    assert [e["loss"] for e in steps_of(events)] == ref_losses


@pytest.mark.parametrize("moment", ["in-flight", "staging"])
def test_sigterm_during_an_async_save_ends_with_a_commit_and_exit_0(
        moment: str, tmp_path: Path, workers: list[Workers]) -> None:
    gate = tmp_path / "gate"
    extra = ["--overlap", "--max-inflight", "2"] if moment == "staging" else []
    w = Workers(tmp_path, 2, ["--ckpt", str(tmp_path / "ckpt"), "--steps", "1000", *ARGS,
                              "--ref-world", "2", "--micro-batch", "3", "--save-every", "5",
                              "--gate", str(gate), *extra])
    workers.append(w)
    # step 5's save is staged and then held at its first data write (the gate is closed); with
    # --overlap and 2 saves in flight, step 10's save waits in its staging phase behind it
    held = 10 if moment == "staging" else 5
    for r in (0, 1):  # each rank's own save: a rank that is still training has none in flight
        w.wait_for(f"save of step {held} on rank {r}", lambda e, r=r: e["ev"] == "save"
                   and e["step"] == held and e["rank"] == r)
    for p in w.procs:
        p.send_signal(signal.SIGTERM)
    sigterms = [w.wait_for(f"SIGTERM on rank {r}", lambda e, r=r: e["ev"] == "sigterm"
                           and e["rank"] == r) for r in (0, 1)]
    phase = "staging" if moment == "staging" else "staged"
    assert [e["save_phase"] for e in sigterms] == [phase, phase]
    gate.touch()
    assert w.wait() == [0, 0], w.logs()
    outcomes = [e for e in read_events(w.events) if e["ev"] == "preempt"]
    assert [(e["saved"], e["exit_code"]) for e in outcomes] == [(True, 0), (True, 0)]
    step = outcomes[0]["step"]
    assert step >= held
    with ckptd.Checkpointer(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="r") as ckpt:
        assert ckpt.latest_step() == step
    loaded_step, _ = final_model(tmp_path / "ckpt")
    assert loaded_step == step


def test_a_rank_killed_with_a_save_in_flight_does_not_hold_the_survivors_at_exit(
        tmp_path: Path, workers: list[Workers], monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 2 dies without a word while step 50's save is in flight; ranks 0 and 1 fail in their
    # next collective and exit with that error. Before, rank 0 (the coordinator) then waited
    # commit_timeout_s (600 s) for rank 2's share at exit, and torchrun restarts nobody while a
    # worker lives: the survivors must be gone well within this test's timeout.
    monkeypatch.setenv("CKPTD_ERROR_EXIT_WAIT_S", "5")
    gate = tmp_path / "gate"
    w = Workers(tmp_path, 3, ["--ckpt", str(tmp_path / "ckpt"), "--steps", "1000", *ARGS,
                              "--save-every", "50", "--gate", str(gate)])
    workers.append(w)
    for r in (0, 1, 2):  # staged on every rank, held at its first data write
        w.wait_for(f"save of step 50 on rank {r}", lambda e, r=r: e["ev"] == "save"
                   and e["step"] == 50 and e["rank"] == r)
    w.procs[2].kill()
    gate.touch()  # the survivors' own shares can be written now; rank 2's never will
    codes = w.wait()
    assert codes[2] == -signal.SIGKILL
    assert codes[0] not in (0, None) and codes[1] not in (0, None), (codes, w.logs())
    log0 = (tmp_path / "worker-0.log").read_text(errors="replace")
    gave_up = [line for line in log0.splitlines() if "error_exit_wait_s" in line]
    assert gave_up and "step 50: ranks [2]" in gave_up[0], log0[-3000:]
    with ckptd.Checkpointer(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="r",
                            read_only=True) as ckpt:
        assert ckpt.latest_step() is None  # step 50 failed; nothing else was ever committed


def test_the_cluster_leaves_no_process_behind_when_interrupted(tmp_path: Path) -> None:
    args = ["--ckpt", str(tmp_path / "ckpt"), "--steps", "100000", *ARGS, "--ref-world", "2",
            "--micro-batch", "3"]
    seen: set[int] = set()
    with pytest.raises(KeyboardInterrupt):
        with Cluster(tmp_path, args, script=TRAIN) as cluster:
            cluster.start_store()
            for _ in range(2):
                cluster.add_node()
            cluster.wait_for("training", step_reached(2, 3), TIMEOUT_S)
            assert cluster.store is not None
            seen = {cluster.store.pid} | {n.proc.pid for n in cluster.nodes}
            seen |= {pid for pid, _ in _descendants({n.proc.pid for n in cluster.nodes})}
            assert len(seen) == 5  # the store, 2 agents, 2 workers
            raise KeyboardInterrupt  # Ctrl-C in the middle of training
    assert [pid for pid in seen if alive(pid)] == []


def test_ckptd_demo_runs_end_to_end_and_draws_the_history(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    # the current directory and the temporary directory (the demo's, torchrun's, the agents')
    # are empty ones of this test's: what the demo leaves in them shows. The temporary one is
    # short: the agents' sockets are in it (a socket path has at most 107 bytes)
    cwd, tmp = tmp_path / "cwd", Path(tempfile.mkdtemp(prefix="ckd"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    workdir = tmp_path / "demo"
    assert main(["demo", "--workdir", str(workdir), "--phase-steps", "15",
                 "--cooldown-s", "2"]) == 0
    out = capsys.readouterr().out
    assert "SIGTERM to node b" in out and "training on 4 nodes" in out and "is lost" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "(" in line]
    assert [row.split("|")[2].strip() for row in rows] == ["3", "2", "3", "4", "3"]
    assert "node lost" in rows[3]
    assert all(row.rstrip(" |").endswith("yes") for row in rows), "a step read other samples"
    # the live log and the table agree on where each phase's training starts
    live = [int(m) for m in re.findall(r"training on \d nodes from step (\d+)", out)]
    assert live == [int(row.split("|")[3].split("–")[0]) for row in rows]
    # the plot is in the work directory, and the output says so; nothing is left elsewhere
    png = workdir / "history.png"
    assert f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(cwd.iterdir()) == [] and list(tmp.iterdir()) == []
    _, meta = read_meta(str(tmp_path / "demo" / "ckpt"))
    assert [e.world_size for e in meta.history] == [3, 2, 3, 4, 3]
    assert {e.global_batch_size for e in meta.history} == {12}
    assert meta.consumed_samples == 12 * max(s for s, _ in meta.losses)
    restarts = meta.history[1:]
    assert all(e.bytes_from_storage is not None for e in restarts)
    # restarts read from the node agents' memory (one may miss it: a node lost while a save
    # was in flight leaves the agents holding that uncommitted step, not the one loaded)
    assert sum(1 for e in restarts if e.bytes_from_memory) >= len(restarts) - 1
    # the demo stopped every node agent it started: those with their directory in its
    # temporary directory (other runs on this machine may start and stop agents meanwhile)
    assert _ckptd_agents(tmp) == set()


def _ckptd_agents(under: Path) -> set[str]:
    """The ckptd node agents running on this machine with their directory under ``under``
    (their /proc entries)."""
    return {p.name for p in Path("/proc").iterdir() if p.name.isdigit()
            and b"ckptd.agent" in (cmd := _cmdline(p)) and f"--dir\0{under}/".encode() in cmd}


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_tensor_parallel_run_resumes_without_tp_on_another_world(
        tmp_path: Path, workers: list[Workers]) -> None:
    # TP=2 x DP=2 for 20 steps (flat buffers hold TP boxes of q/k/v/o/fc1/fc2), then TP=1 x DP=3
    args = [*ARGS, "--ref-world", "2", "--micro-batch", "3"]
    tp_dir, ref_dir = tmp_path / "tp", tmp_path / "reference"
    tp_dir.mkdir()
    ref_dir.mkdir()
    ckpt = ["--ckpt", str(tp_dir / "ckpt")]
    first = Workers(tp_dir, 4, [*ckpt, "--steps", "20", "--tp", "2", *args])
    workers.append(first)
    assert first.wait() == [0, 0, 0, 0], first.logs()
    second = Workers(tp_dir, 3, [*ckpt, "--steps", "40", *args])
    ref = Workers(ref_dir, 3, ["--ckpt", str(ref_dir / "ckpt"), "--steps", "40", *args])
    workers += [second, ref]
    assert second.wait() == [0, 0, 0], second.logs()
    assert ref.wait() == [0, 0, 0], ref.logs()
    resumes = [e for e in read_events(second.events) if e["ev"] == "resume" and e["rank"] == 0]
    assert [(e["step"], e["world"], e["reason"]) for e in resumes] == [(0, 2, "start"),
                                                                       (20, 3, "scale-up")]
    _, tp_model = final_model(tp_dir / "ckpt", 40)
    _, ref_model = final_model(ref_dir / "ckpt", 40)
    for key in ref_model:
        assert (tp_model[key] - ref_model[key]).abs().max().item() <= PARAM_ATOL, key
