"""Lightning with ckptd as its CheckpointIO, with lightning itself: a real ``Trainer`` (DDP,
gloo on 127.0.0.1) under torchrun (``tests/lightning_job.py``), configured as
docs/integrations.md shows; killed by SIGKILL after a committed save on 2 processes, resumed on
3 and on 2 bit-exact against an uninterrupted run. In process: Fabric's save and load through
the plugin, and what the plugin keeps, refuses and removes."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import CkptdError

pytestmark = pytest.mark.slow
JOB = Path(__file__).resolve().parent / "lightning_job.py"
ROOT = Path(__file__).resolve().parent.parent


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (type(a) is type(b) and list(a) == list(b)
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(workdir: Path, world: int, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           str(world), "--master-addr", "127.0.0.1", "--master-port", str(_port()), str(JOB),
           "--workdir", str(workdir), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(job: subprocess.Popen[str]) -> None:
    try:
        out, _ = job.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
        out, _ = job.communicate(timeout=60)
        pytest.fail("the job timed out:\n" + out[-4000:])
    assert job.returncode == 0, out[-4000:]


def _recorded(workdir: Path, tag: str, when: str, world: int) -> list[Any]:
    return [torch.load(workdir / f"{tag}-{when}-{r}.pt", weights_only=False) for r in range(world)]


def test_a_lightning_job_killed_on_2_processes_resumes_on_3_and_on_2_bit_exact(tmp_path):
    # the uninterrupted reference, through Lightning's own async wrapper around the plugin
    ref = tmp_path / "ref"
    _finish(_job(ref, 2, "--epochs", "4", "--tag", "ref", "--io", "lightning-async"))
    reference = _recorded(ref, "ref", "epoch2", 2)
    # the documented configuration (ckptd's save_async), killed at the start of epoch 2 once the
    # checkpoint of epoch 1 is committed: SIGKILL of torchrun's whole process group
    work = tmp_path / "job"
    killed = _job(work, 2, "--epochs", "4", "--tag", "killed", "--stop-at", "2")
    assert killed.stdout is not None
    lines, workers = [], []
    try:
        for line in killed.stdout:
            lines.append(line)
            workers += [int(pid) for pid in re.findall(r"READY (\d+)", line)]
            if len(workers) == 2:
                break
        else:
            pytest.fail("the job ended before it was killed:\n" + "".join(lines[-60:]))
    finally:  # torchrun starts each worker in a session of its own: every group, by its id
        for group in [killed.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    for state in _recorded(work, "killed", "epoch2", 2):
        assert _same(state, reference[0])
    # on 3 processes: model, AdamW (betas too), LR scheduler, loops, epoch and step as saved
    on3 = tmp_path / "on3"  # a copy: the run saves checkpoints of its own
    shutil.copytree(work / "checkpoints", on3 / "checkpoints")
    _finish(_job(on3, 3, "--epochs", "3", "--tag", "on3", "--resume"))
    for state in _recorded(on3, "on3", "epoch2", 3):
        assert _same(state, reference[0])
    # on 2 processes it trains on to the end bit for bit as the uninterrupted run did
    _finish(_job(work, 2, "--epochs", "4", "--tag", "resumed", "--resume"))
    end, ref_end = _recorded(work, "resumed", "end", 2), _recorded(ref, "ref", "end", 2)
    assert all(_same(a, b) for a, b in zip(end, ref_end, strict=True))


# -- in process -------------------------------------------------------------------------------


def _plugin(**kw: Any) -> Any:
    from ckptd.integrations.lightning import CkptdCheckpointIO

    return CkptdCheckpointIO(agent=False, **kw)


def test_fabric_saves_and_loads_through_the_plugin_exactly(tmp_path):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[_plugin()])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model, opt = fabric.setup(model, opt)
    fabric.backward(model(torch.randn(4, 3)).sum())
    opt.step()
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "opt": opt, "step": 1, "tag": ("a", 2), "raw": b"\0x"})
    saved = {"model": model.state_dict(), "opt": opt.state_dict()}
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh, fresh_opt = fabric.setup(fresh, fresh_opt)
    rest = fabric.load(path, {"model": fresh, "opt": fresh_opt})
    assert _same(fresh.state_dict(), saved["model"])
    assert _same(fresh_opt.state_dict(), saved["opt"])  # int keys, betas a tuple again
    assert rest == {"step": 1, "tag": ("a", 2), "raw": b"\0x"}
    assert path.is_dir() and (path / "step-000000000").is_dir()  # a ckptd root, step 0
    from ckptd.cli import main

    assert main(["verify", str(path)]) == 0


def test_a_value_json_cannot_hold_is_refused_by_key_unless_pickling_is_allowed(tmp_path):
    ns = argparse.Namespace(lr=0.1)
    checkpoint = {"global_step": 3, "state_dict": {"w": torch.ones(2)},
                  "hyper_parameters": {"args": ns}}
    with pytest.raises(CkptdError, match=r"hyper_parameters/args: a Namespace .*allow_pickle"):
        _plugin().save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    pickling = _plugin(allow_pickle=True)
    pickling.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    pickling.teardown()
    with pytest.raises(CkptdError, match=r"hyper_parameters/args was pickled"):
        _plugin().load_checkpoint(tmp_path / "a.ckpt")
    loaded = pickling.load_checkpoint(tmp_path / "a.ckpt")
    assert loaded["hyper_parameters"]["args"] == ns and loaded["global_step"] == 3


def test_keys_lightning_uses_come_back_with_their_types_and_remove_deletes_the_root(tmp_path):
    best = str(tmp_path / "ck" / "epoch=0-step=3.ckpt")
    checkpoint = {
        "epoch": 0, "global_step": 3,
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}},
                              "param_groups": [{"params": [0], "betas": (0.9, 0.999)}]}],
        "callbacks": {"ModelCheckpoint{'monitor': None, 'mode': 'min'}": {
            "best_k_models": {best: torch.tensor(0.5)}, "best_model_path": best}},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.state_dict": {"_x": 1.5}}},
        "lr_schedulers": [{"_last_lr": [0.1], "last_epoch": 3}],
        "float_keys": {0.5: "half", None: "none", True: "yes"},
    }
    io = _plugin(async_save=True)
    path = tmp_path / "ck" / "last.ckpt"
    io.save_checkpoint(checkpoint, path)
    assert _same(io.load_checkpoint(path), checkpoint)  # waits for its own save in flight
    checkpoint["global_step"] = 4
    io.save_checkpoint(checkpoint, path)
    io.teardown()
    assert sorted(p.name for p in path.glob("step-*")) == ["step-000000004"]  # keep_last=1
    io.remove_checkpoint(path)
    assert not path.exists()
    with pytest.raises(CkptdError, match="no committed ckptd checkpoint"):
        io.load_checkpoint(path)
    torch.save({"epoch": 0}, tmp_path / "old.ckpt")
    with pytest.raises(CkptdError, match=r"old.ckpt: a file, not a ckptd root .*TorchCheckpointIO"):
        io.load_checkpoint(tmp_path / "old.ckpt")
