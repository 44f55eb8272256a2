"""The public surface is exactly API.md's names."""

import ckptd

API_NAMES = {
    "init",
    "save_async",
    "save",
    "wait",
    "latest_step",
    "load",
    "Checkpointer",
    "SaveHandle",
    "SaveResult",
    "LoadResult",
    "Shard",
    "FlatShard",
    "Fused",
    "Local",
    "CkptdError",
    "CorruptCheckpoint",
    "StateMismatch",
    "on_preemption",
    "preempted",
    "elastic",
}


def test_all_is_exactly_the_documented_public_names():
    assert set(ckptd.__all__) == API_NAMES
    for name in API_NAMES:
        assert getattr(ckptd, name) is not None


def test_errors_inherit_the_matching_builtins():
    assert issubclass(ckptd.CorruptCheckpoint, ckptd.CkptdError)
    assert issubclass(ckptd.CorruptCheckpoint, ValueError)
    assert issubclass(ckptd.StateMismatch, ckptd.CkptdError)
    assert issubclass(ckptd.elastic.NoFeasiblePlan, ckptd.CkptdError)
