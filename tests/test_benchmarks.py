"""Every benchmark runs, small (slow: ~3 minutes together).

The benchmarks import the library's insides (readers, storage classes, plans) that tests do not
reach through the public API, and CI does not run them: four of them had stopped running (an
import of a renamed class, a changed signature, frames read from a format-3 manifest) before this
test. Each runs here at the smallest size that takes its whole path, in a scratch directory of
its own, which it must leave empty; none may leave a node agent behind (the ``agents`` fixture).
The figures are not checked: at these sizes they mean nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"

RUNS = {
    "catalog": ["--tensors", "20", "--ranks", "4", "--steps", "3"],
    "checksum": ["--size", "16MiB", "--runs", "1"],
    "planes": ["--mib", "8", "--runs", "1"],
    "commit": ["--world", "2", "--saves", "2", "--runs", "1", "--wait-s", "0.2", "--lag", "2"],
    "tiny_threads": ["--world", "2", "--saves", "2", "--runs", "1"],
    "module_passes": [],
    "frames": ["--size", "32MiB", "--ranks", "2"],
    "save_phases": ["--size-mib", "32", "--saves", "1"],
    "save": ["--size", "32MiB", "--runs", "1", "--warmup", "0", "--sections", "floors,ckptd"],
    "load": ["--size", "32MiB", "--worlds", "2", "--sections", "unit,load"],
    "reshard": ["--worlds", "2", "--hidden", "64", "--layers", "1", "--vocab", "500"],
    "scale": ["--world", "8", "--shrink", "256"],
    "s3_floor": ["--mib", "8", "--repeat", "1"],
    "s3": ["--size", "16MiB", "--runs", "1"],
    "agent_start": ["--runs", "1"],
    "agent": ["--size", "32MiB", "--world", "2", "--saves", "1", "--contend", "0",
              "--stall-only", "--gap", "0.2"],
    "peer_copy": ["--size", "16MiB", "--world", "2", "--saves", "1", "--gap", "0.2"],
    "handover": ["--size", "64MiB", "--rate", "16MB", "--runs", "1", "--grace", "1"],
    "data": ["--runs", "1", "--samples", "200", "--sizes", "1000,100000", "--shards", "100,1000",
             "--randperm-max", "100000"],
}


def test_every_benchmark_is_in_the_list():
    scripts = {p.stem for p in BENCH.glob("*.py")} - {"common", "multirank"}
    assert scripts == set(RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_benchmark_runs_and_leaves_nothing_behind(name, tmp_path, agents):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "CKPTD_BENCH_DIR": str(scratch), "PYTHONPATH": str(BENCH.parent)}
    env.pop("CKPTD_AGENT")  # the benchmarks choose (common.py)
    out = subprocess.run([sys.executable, f"{name}.py", *RUNS[name]], cwd=BENCH, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{name}.py failed:\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{name}.py printed nothing:\n{out.stderr[-2000:]}"
    assert not list(scratch.iterdir()), f"{name}.py left {list(scratch.iterdir())}"


@pytest.mark.slow
def test_the_tiny_save_timeline_prints_every_event(tmp_path, agents):
    """``commit.py --timeline``: its wrappers still find the functions they stamp (a renamed
    one would leave its event out of every save)."""
    env = {**os.environ, "CKPTD_BENCH_DIR": str(tmp_path), "PYTHONPATH": str(BENCH.parent)}
    env.pop("CKPTD_AGENT")
    out = subprocess.run([sys.executable, "commit.py", "--timeline", "--world", "2", "--saves",
                          "2", "--dir", str(tmp_path)], cwd=BENCH, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for event in ("staged", "partial written", "merge starts", "manifest written", "result()"):
        assert f"| {event}" in out.stdout or f"| rank 0: {event}" in out.stdout, out.stdout
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "every"])
def test_the_tiny_save_with_the_node_agent_runs_and_stops_its_agent(tmp_path, agents, mode):
    """``commit.py --agent [every] --contend 1``: the default path's figure (the agent running,
    these tiny saves written by their ranks), or every save through the agent, with the agent's
    CPU read from /proc and a process spinning beside the ranks; the agent it started is stopped
    at the end (no ``pgrep`` finds it: the fixture checks)."""
    env = {**os.environ, "CKPTD_BENCH_DIR": str(tmp_path), "PYTHONPATH": str(BENCH.parent)}
    env.pop("CKPTD_AGENT")
    env.pop("CKPTD_AGENT_MIN_BYTES")  # (the suite's 0): the default, or what --agent every sets
    out = subprocess.run([sys.executable, "commit.py", "--agent", mode, "--world", "2",
                          "--saves", "2", "--runs", "1", "--wait-s", "0", "--lag", "0",
                          "--contend", "1", "--dir", str(tmp_path)], cwd=BENCH, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    label = {"default": "node agent running, default path",
             "every": "every save through the node agent"}[mode]
    assert f"| ckptd ({label}): save_async" in out.stdout, out.stdout
    assert "| not counted |" in out.stdout, out.stdout
    # the summary's ratio is the runs' own (each run's saves against its own floor)
    summary = next(line for line in out.stdout.splitlines() if line.startswith("medians of"))
    assert "the runs' own ratios" in summary and "host probe" in summary, summary
    assert summary.startswith("medians of 1 runs (1 busy processes)"), summary
    assert "stopped" in out.stdout, out.stdout
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_codec_benchmark_prints_each_file_next_to_its_floor(tmp_path, agents):
    """``commit.py --codec``: a row for the tiny save's partial and manifest and for the large
    partial, each with its decode, encode and their floors."""
    env = {**os.environ, "CKPTD_BENCH_DIR": str(tmp_path), "PYTHONPATH": str(BENCH.parent)}
    env.pop("CKPTD_AGENT")
    out = subprocess.run([sys.executable, "commit.py", "--codec", "20", "--world", "2",
                          "--runs", "1", "--dir", str(tmp_path)], cwd=BENCH, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines()
            if line.startswith("| ") and "bytes" not in line]
    assert [r[0].strip().rsplit(": ", 1)[1] for r in rows] == [
        "partial of rank 1", "manifest", "partial of rank 1"], out.stdout
    assert "20 tensors" in rows[2][0]
    assert all(float(x.replace(",", "")) > 0 for r in rows for x in r[1:]), out.stdout
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())
