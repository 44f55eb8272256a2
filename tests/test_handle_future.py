"""A save's handle is a concurrent.futures.Future of its SaveResult; the staged point is a
second Future; only ckptd completes them; a skipped save says so."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch
from faulty_storage import FailAfterBytes

import ckptd


def _state(v: float = 1.0) -> dict:
    return {"w": torch.full((1 << 14,), v), "step": 0}


def test_save_async_returns_a_future_whose_callback_gets_the_result_once(tmp_path):
    ckptd.init(str(tmp_path / "r"))
    try:
        calls: list[object] = []
        called = threading.Event()
        handle = ckptd.save_async(_state(), step=3)
        assert isinstance(handle, concurrent.futures.Future)
        assert isinstance(handle.staged, concurrent.futures.Future)

        def callback(f: concurrent.futures.Future) -> None:
            calls.append(f.result())
            called.set()

        handle.add_done_callback(callback)
        done, _ = concurrent.futures.wait([handle], timeout=60)
        assert done == {handle}
        assert called.wait(60)
        result = handle.result(timeout=60)
        assert calls == [result]  # once, with the SaveResult
        assert result.step == 3 and result.skipped is False
        assert handle.exception() is None
        assert handle.staged.done() and handle.staged.result() is None
        assert handle.cancel() is False  # a save cannot be called off
        assert handle.phase is ckptd.Phase.COMMITTED
        # a callback added after completion runs at once, once
        late: list[object] = []
        handle.add_done_callback(lambda f: late.append(f.result()))
        assert late == [result]
    finally:
        ckptd.close()


def test_a_failed_save_calls_the_callback_once_with_its_error_raised_once(tmp_path):
    root = str(tmp_path)
    c = ckptd.Checkpointer(root, storage=FailAfterBytes(root, limit=1000))
    errors: list[BaseException | None] = []
    called = threading.Event()
    handle = c.save_async({"w": torch.ones(1 << 16)}, step=1)

    def callback(f: concurrent.futures.Future) -> None:
        errors.append(f.exception())
        called.set()

    handle.add_done_callback(callback)
    assert called.wait(60)
    assert len(errors) == 1 and isinstance(errors[0], ckptd.StorageError)
    with pytest.raises(ckptd.StorageError):
        handle.result()
    c.wait()  # the caller has had it from the handle: not raised again
    c.close()


def test_only_ckptd_completes_a_handle(tmp_path):
    with ckptd.Checkpointer(str(tmp_path)) as c:
        handle = c.save_async(_state(), step=1)
        result = handle.result()
        with pytest.raises(RuntimeError, match="completed by ckptd"):
            handle.set_result(result)
        with pytest.raises(RuntimeError, match="completed by ckptd"):
            handle.staged.set_exception(ValueError("x"))
        public = {n for n in dir(handle) if not n.startswith("_")}
        producer = {"mark_staged", "mark_committed", "mark_failed", "mark_handed",
                    "take_error", "wait_done", "on_wait_staged"}
        assert public & producer == set()
        assert {"staged", "wait_staged", "wait_safe", "phase", "stall_s", "step",
                "url"} <= public


def test_a_skipped_save_is_distinguishable_from_a_committed_one(tmp_path):
    from ckptd import config

    root = str(tmp_path)
    with ckptd.Checkpointer(root, rank=0, world_size=2, run_id="j", on_busy="skip") as c, \
            config.override(commit_timeout_s=30.0):
        first = c.save_async(_state(1.0), step=1)  # waits for rank 1's partial
        second = c.save_async(_state(2.0), step=2)
        assert second.done()
        assert second.phase is ckptd.Phase.SKIPPED
        assert second.result().skipped is True and second.result().nbytes == 0
        assert second.staged.done()
        with ckptd.Checkpointer(root, rank=1, world_size=2, run_id="j") as other:
            other.save_async(_state(1.0), step=1).result()
        assert first.result().skipped is False
