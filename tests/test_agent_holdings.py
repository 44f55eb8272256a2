"""What a node agent keeps in memory and when it lets go (ckptd.agent.holdings), in one process:
the rules the multi-process tests in test_agent.py rely on, each case on its own."""

import os

import pytest

from ckptd.agent import node_memory
from ckptd.agent.holdings import HeldStep, Holdings, OverBudget
from ckptd.agent.shm import unlink

ROOT = {"url": "/job/root", "options": None}
OTHER = {"url": "/other/root", "options": None}


class Trainer:
    """A session whose arenas the memory gives back."""


@pytest.fixture
def memory():
    given_back: list[tuple[object, int]] = []
    owners = {ROOT["url"]: "run1", OTHER["url"]: "run1"}  # owner.json, per root
    asked: list[str] = []

    def owner_of(spec):
        asked.append(spec["url"])
        return owners.get(spec["url"])

    mem = Holdings(1, None, lambda owner, seg_id: given_back.append((owner, seg_id)), owner_of)
    mem.given_back, mem.owners, mem.asked = given_back, owners, asked
    mem.made = []  # every segment a test created: a trainer's arenas are not the memory's
    yield mem
    mem.close()
    for seg in mem.made:
        unlink(seg.path)


def _step(mem: Holdings, step: int, *, owner=None, seg_id=-1, origin=None, committed=False,
          run="run1") -> HeldStep:
    seg = mem.create(4096, f"test{os.getpid()}")
    mem.made.append(seg)
    return HeldStep(step, seg, {f"step-{step}/{run}/{origin}": (0, 4096)}, owner, seg_id,
                origin=origin, committed=committed, run=run)


def _held(mem: Holdings, spec=ROOT) -> list[tuple[str, int, str | None, bool]]:
    """(run, step, origin, committed) of every step of the root held, in that order."""
    files, pinned = mem.pin_files(spec)
    for k in pinned:
        mem.pin(k, -1)
    return sorted(((k.run, k.step, k.origin, k.committed) for k in pinned),
                  key=lambda h: (h[0], h[1], h[2] or "", h[3]))


def _steps(mem: Holdings, spec=ROOT) -> list[int]:
    return sorted(step for _, step, _, _ in _held(mem, spec))


def test_a_rank_keeps_its_newest_committed_step_and_one_written_after_it(memory):
    t = Trainer()
    memory.keep(ROOT, 1, _step(memory, 1, owner=t, seg_id=0))
    assert memory.commit_seen(ROOT, 1, 1, t)[1] == []
    memory.keep(ROOT, 1, _step(memory, 2, owner=t, seg_id=1))  # its commit not heard of yet
    assert _held(memory) == [("run1", 1, None, True), ("run1", 2, None, False)]
    # a third step written before step 2's commit is heard of: step 2 goes back to its trainer
    assert memory.keep(ROOT, 1, _step(memory, 3, owner=t, seg_id=2)) == [1]
    assert _held(memory) == [("run1", 1, None, True), ("run1", 3, None, False)]
    # step 3 commits: step 1's arena is free again
    kept, released = memory.commit_seen(ROOT, 1, 3, t)
    assert kept is not None and kept.step == 3 and released == [0]


def test_a_commit_drops_every_older_step_of_the_root_whoever_holds_it(memory):
    t = Trainer()
    used = memory.used
    memory.keep(ROOT, 1, _step(memory, 1, origin="b", committed=True))  # a lost node's copy
    memory.keep(ROOT, 3, _step(memory, 1, committed=True))  # a rank of a larger world, gone
    memory.keep(ROOT, 2, _step(memory, 1))  # a step that never committed
    other = Trainer()
    memory.keep(ROOT, 0, _step(memory, 1, owner=other, seg_id=7, committed=True))
    memory.keep(OTHER, 1, _step(memory, 1, committed=True))  # another root: not its business
    assert len(_held(memory)) == 4
    # the new world's rank 0 commits step 2: no restart of this root loads step 1 any more
    assert memory.keep(ROOT, 0, _step(memory, 2, owner=t, seg_id=0, committed=True)) == []
    assert _held(memory) == [("run1", 2, None, True)]
    assert memory.given_back == [(other, 7)]  # a live trainer's arena goes back to it
    # the agent's own were removed: left are step 2, the arena given back, the other root's
    assert memory.used == used + 3 * 4096
    assert _steps(memory, OTHER) == [1]


def test_a_new_owner_s_steps_replace_an_earlier_run_s_once_it_commits_whatever_the_numbers(
        memory):
    memory.keep(ROOT, 0, _step(memory, 500, committed=True, run="run1"))
    memory.keep(ROOT, 1, _step(memory, 500, origin="b", committed=True, run="run1"))
    # a new run takes the root (owner.json) and restarts from an older step: until it commits,
    # run1's step 500 is what a restart loads
    memory.owners[ROOT["url"]] = "run2"
    memory.keep(ROOT, 0, _step(memory, 301, run="run2"))
    assert _steps(memory) == [301, 500, 500]
    t = Trainer()
    memory.keep(ROOT, 1, _step(memory, 301, owner=t, seg_id=0, run="run2"))
    assert memory.commit_seen(ROOT, 1, 301, t)[0] is not None  # run2's first commit heard of
    assert _held(memory) == [("run2", 301, None, False), ("run2", 301, None, True)]
    # a copy of run1's step that arrives late is dropped at once
    asked = len(memory.asked)
    late = _step(memory, 501, origin="b", committed=True, run="run1")
    memory.keep(ROOT, 1, late)
    assert late.dropped and len(_held(memory)) == 2
    assert len(memory.asked) == asked + 1  # run1 is not the owner last learnt: asked again


def test_nothing_is_dropped_across_runs_while_who_owns_the_root_is_unknown(memory):
    memory.keep(ROOT, 0, _step(memory, 500, committed=True, run="run1"))
    memory.owners[ROOT["url"]] = None  # owner.json unreadable
    memory.keep(ROOT, 1, _step(memory, 7, origin="b", committed=True, run="run2"))
    assert _steps(memory) == [7, 500]


def test_the_commit_of_a_step_number_two_runs_saved_marks_the_newer_one(memory):
    t = Trainer()
    memory.keep(ROOT, 1, _step(memory, 5, committed=True, run="run1"))
    memory.owners[ROOT["url"]] = "run2"
    memory.keep(ROOT, 1, _step(memory, 5, owner=t, seg_id=0, run="run2"))
    kept, _ = memory.commit_seen(ROOT, 1, 5, t)
    assert kept is not None and kept.run == "run2"
    assert _held(memory) == [("run2", 5, None, True)]


def test_a_peer_s_copies_of_two_steps_in_flight_wait_for_their_notices(memory):
    """A sender with max_inflight=2 and CKPTD_PEER_COPY=staged sends step 3's copy before it
    can tell that step 2 committed: both stay beside the committed step 1."""
    memory.keep(ROOT, 1, _step(memory, 1, origin="b", committed=True))
    memory.keep(ROOT, 1, _step(memory, 2, origin="b"))
    memory.keep(ROOT, 1, _step(memory, 3, origin="b"))
    assert _steps(memory) == [1, 2, 3]
    assert memory.peer_committed(ROOT, "b", 1, 2)
    assert _held(memory) == [("run1", 2, "b", True), ("run1", 3, "b", False)]
    # a failed step's copy is pushed out by the next ones, and dropped at the next commit
    memory.keep(ROOT, 1, _step(memory, 4, origin="b"))
    memory.keep(ROOT, 1, _step(memory, 5, origin="b"))
    assert _steps(memory) == [2, 4, 5]
    assert memory.peer_committed(ROOT, "b", 1, 5)
    assert _held(memory) == [("run1", 5, "b", True)]
    assert not memory.peer_committed(ROOT, "b", 1, 3)  # gone: the sender is told so


def test_a_step_being_read_is_removed_only_once_the_read_is_done(memory):
    old = _step(memory, 1, origin="b", committed=True)
    memory.keep(ROOT, 1, old)
    files, pinned = memory.pin_files(ROOT)
    memory.keep(ROOT, 0, _step(memory, 2, committed=True))
    assert old.dropped and os.path.exists(old.segment.path)  # the load still maps it
    for k in pinned:
        memory.pin(k, -1)
    assert not os.path.exists(old.segment.path)


def test_the_owner_is_read_from_owner_json_and_an_unreadable_one_is_said_once(tmp_path, caplog):
    """The agent's answer to ``owner_of``: the run in ``owner.json``; None (nothing dropped across
    runs) while the root has none or it cannot be read, and that warning once, not per save."""
    from ckptd.agent.server import Agent

    agent = Agent("node-x", str(tmp_path / "sock"))
    try:
        spec = {"url": str(tmp_path / "root"), "options": None}
        (tmp_path / "root").mkdir()
        assert agent._owner_of(spec) is None  # no owner.json yet: no warning
        (tmp_path / "root" / "owner.json").write_text("{not json")
        with caplog.at_level("WARNING", logger="ckptd.agent"):
            assert [agent._owner_of(spec) for _ in range(3)] == [None] * 3
        said = [r.getMessage() for r in caplog.records if "who owns" in r.getMessage()]
        assert len(said) == 1 and "owner.json: unreadable" in said[0], said
        (tmp_path / "root" / "owner.json").write_text('{"run": "run7", "generation": 2}')
        assert agent._owner_of(spec) == "run7"
    finally:
        agent.holdings.close()


def test_a_segment_must_leave_the_node_its_reserve_once_the_orphans_are_dropped(monkeypatch):
    """The budget bounds the agent; the reserve protects the trainers beside it: a new segment
    that would leave the node less free memory than the reserve is refused, after the steps of
    trainers that are gone are dropped (their memory counts as free again)."""
    monkeypatch.setenv("CKPTD_AGENT_MEM_RESERVE", "1MiB")
    node = {"left": 64 << 20}
    mem = Holdings(1, None, lambda owner, seg_id: None, host=lambda: (1 << 30, node["left"]))
    mem.made = []
    try:
        assert mem.reserve == 1 << 20
        gone = _step(mem, 1, committed=True)  # owner None: its trainer is gone
        mem.keep(ROOT, 0, gone)
        node["left"] = (1 << 20) + 4096 - 1  # 4096 bytes more: one byte under the reserve
        _step(mem, 2)  # fits once the orphan's 4096 bytes are given back
        assert not os.path.exists(gone.segment.path)
        with pytest.raises(OverBudget, match=r"under the agent's 1048576-byte reserve "
                                             r"\(CKPTD_AGENT_MEM_RESERVE\)"):
            _step(mem, 3)  # nothing left to drop
        node["left"] = (1 << 20) + 4096
        _step(mem, 4)
    finally:
        mem.close()
        for seg in mem.made:
            unlink(seg.path)


def test_the_memory_left_is_the_host_s_or_its_cgroup_s_whichever_is_less(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        1000 kB\nMemFree:  10 kB\nMemAvailable:     600 kB\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("512000\n")
    (v2 / "memory.current").write_text("400000\n")
    (v2 / "memory.stat").write_text("anon 290000\ninactive_file 100000\n")
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    (v1 / "memory.stat").write_text("total_inactive_file 0\n")
    assert node_memory.left(str(meminfo), []) == (1024000, 614400)
    assert node_memory.left(str(meminfo), [(str(v1), node_memory._V1)]) == (1024000, 614400)
    # the working set: 400000 in use, of which 100000 inactive page cache
    assert node_memory.left(str(meminfo), [(str(v2), node_memory._V2)]) == (512000, 212000)
    assert node_memory.left(str(tmp_path / "absent"), [(str(tmp_path), node_memory._V2)]) is None
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/pod/abc\n3:cpu,cpuacct:/pod\n0::/pod/abc/main\n")
    assert node_memory._own_cgroups(str(proc), "/sys/fs/cgroup") == [
        ("/sys/fs/cgroup/memory/pod/abc", node_memory._V1),
        ("/sys/fs/cgroup/pod/abc/main", node_memory._V2)]
    here = node_memory.left()  # this machine's
    assert here is not None and 0 < here[1] <= here[0]


def test_a_step_of_a_run_not_yet_owning_the_root_outlives_the_old_owner_s_commits(memory):
    """Rank 1 of a new run saves before its rank 0 claimed the root (owner.json still names the
    old run, whose steps go on committing here): its step is the next owner's, not an earlier
    run's, and stays; once the new run owns the root and commits, the old run's steps go. (It
    was dropped at once: a restart then read rank 1 from storage, not memory.)"""
    memory.keep(ROOT, 0, _step(memory, 4, committed=True, run="run1"))
    memory.keep(ROOT, 1, _step(memory, 4, committed=True, run="run1"))
    memory.keep(ROOT, 1, _step(memory, 5, run="run2"))  # owner.json: still run1
    assert _held(memory) == [("run1", 4, None, True), ("run1", 4, None, True),
                             ("run2", 5, None, False)]
    memory.owners[ROOT["url"]] = "run2"  # rank 0 claims it and commits step 5
    memory.owned_by(ROOT, "run2")
    memory.keep(ROOT, 0, _step(memory, 5, committed=True, run="run2"))
    assert _held(memory) == [("run2", 5, None, False), ("run2", 5, None, True)]
    # run1 is an earlier owner now: a late copy of one of its steps is dropped at once
    late = _step(memory, 6, origin="b", committed=True, run="run1")
    memory.keep(ROOT, 1, late)
    assert late.dropped
