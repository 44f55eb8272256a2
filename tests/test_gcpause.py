"""The cyclic collector is paused while manifests are decoded and comes back as it was."""

from __future__ import annotations

import gc
import threading

import torch

import ckptd
from ckptd import catalog, gcpause
from ckptd.loader import reader as step_reader
from ckptd.writer import commit


def _watch(monkeypatch, module, name: str, seen: list[tuple[str, bool]]) -> None:
    """Record whether the collector is enabled whenever ``module.name`` runs."""
    fn = getattr(module, name)

    def watched(*args, **kw):
        seen.append((name, gc.isenabled()))
        return fn(*args, **kw)

    monkeypatch.setattr(module, name, watched)


def test_decoding_runs_with_the_collector_paused_and_it_comes_back_as_it_was(tmp_path,
                                                                               monkeypatch):
    seen: list[tuple[str, bool]] = []
    _watch(monkeypatch, commit, "merge", seen)  # the coordinator's thousand partials
    _watch(monkeypatch, catalog, "decode_manifest", seen)  # a load's manifest
    _watch(monkeypatch, step_reader, "load_into", seen)  # and its plan
    state = {f"w{i}": torch.full((64,), float(i)) for i in range(5)}
    # in process, whichever executor the suite runs: the merge watched is this process's
    with ckptd.Checkpointer(str(tmp_path), agent=False) as c:
        c.save(state, step=1)
    assert seen == [("merge", False)] and gc.isenabled()
    dst = {k: torch.zeros(64) for k in state}
    with ckptd.Checkpointer(str(tmp_path), read_only=True) as reader:
        seen.clear()
        reader.load(dst, step=1)
        assert seen == [("decode_manifest", False), ("load_into", False)] and gc.isenabled()
        assert all(torch.equal(dst[k], state[k]) for k in state)
        gc.disable()
        try:
            reader.load(dst, step=1)
            assert not gc.isenabled()  # the caller's choice stays
        finally:
            gc.enable()


def test_overlapping_pauses_of_two_threads_end_with_the_last():
    entered, release = threading.Event(), threading.Event()

    def other():
        with gcpause.paused():
            entered.set()
            release.wait()

    t = threading.Thread(target=other)
    with gcpause.paused():
        t.start()
        entered.wait()
    assert not gc.isenabled()  # the other thread is still inside
    release.set()
    t.join()
    assert gc.isenabled()


def test_the_offline_reshard_runs_with_the_collector_paused(tmp_path, monkeypatch):
    from ckptd.cli import main as cli_main
    from ckptd.elastic import resharder as offline

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    state = {"w": torch.arange(64.0)}
    with ckptd.Checkpointer(src) as c:
        c.save(state, step=1)
    seen: list[tuple[str, bool]] = []
    _watch(monkeypatch, offline.Resharder, "run", seen)
    assert cli_main(["reshard", src, "--to-world", "2", "--out", dst]) == 0
    assert [enabled for _, enabled in seen] == [False] and gc.isenabled()
    dest = {"w": torch.zeros(64)}
    with ckptd.Checkpointer(dst, read_only=True) as reader:
        reader.load(dest)
    assert torch.equal(dest["w"], state["w"])
