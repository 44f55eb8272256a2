"""The error hierarchy.

::

    CkptdError                      every error ckptd raises on purpose
    ├── CorruptCheckpoint (ValueError)        bad bytes or manifest on storage: names file + tensor
    ├── CheckpointNotFound (FileNotFoundError) no committed checkpoint where one was asked for
    ├── StateMismatch (ValueError)            the destination state does not fit the checkpoint
    ├── StorageError (OSError)                the storage refused a write/read (full disk, network)
    ├── ForeignWriter                         another job or an older world writes to the same root
    │   (the five above: here, and importable from ``ckptd``)
    ├── UntrustedPickle (PermissionError)     a DCP ``.metadata`` pickle, read only with trust=True
    │                                         (``ckptd.interop.dcp_format``)
    ├── LayoutError (ValueError)              a layout file for ``ckptd reshard`` is invalid
    │                                         (``ckptd.loader.layout_file``)
    ├── InvalidSpec (ValueError)              a TrainingSpec/ModelSpec is inconsistent
    │                                         (``ckptd.elastic.specs``)
    ├── NoFeasiblePlan (ValueError)           no batch setting fits the tolerance and memory
    │                                         (``ckptd.elastic.search``)
    ├── NotElastic (ValueError)               a step's training metadata is not an elastic run's
    │                                         (``ckptd.elastic.history``)
    ├── DataMismatch (ValueError)             a resume's data order is not the checkpoint's
    │                                         (``ckptd.data.order``)
    ├── PreemptionError (RuntimeError)        the preemption save could not be made durable
    │                                         (``ckptd.elastic.preemption``)
    └── DemoError (RuntimeError)              ``ckptd demo`` could not run
                                              (``ckptd.demo.cluster``)

Each error outside this module lives with the part that raises it; catching ``CkptdError``
catches all thirteen.

Messages are one line and carry the bad value and the file or logical tensor name; the original
exception, if any, is kept as ``__cause__``.
"""

from __future__ import annotations


class CkptdError(Exception):
    """Base class of every error raised by ckptd.

    Example:
        import tempfile
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            try:
                ckpt.load({})
            except ckptd.CkptdError as e:  # catches every ckptd error
                print(type(e).__name__, e)
            else:
                raise AssertionError("no error")
    """


class CorruptCheckpoint(CkptdError, ValueError):
    """A manifest or data file is missing, truncated, tampered with or of an unknown version.

    Example:
        import os
        import tempfile
        import torch
        import ckptd

        root = tempfile.mkdtemp()
        with ckptd.Checkpointer(root) as ckpt:
            ckpt.save({"w": torch.ones(4)}, step=1)
        step_dir = os.path.join(root, "step-000000001")
        with open(os.path.join(step_dir, "manifest.json"), "r+b") as f:
            f.seek(20)
            f.write(b"#")  # damage the manifest
        try:
            with ckptd.Checkpointer(root, read_only=True) as ckpt:
                ckpt.load({"w": torch.zeros(4)}, step=1)
        except ckptd.CorruptCheckpoint as e:
            assert isinstance(e, ValueError)
        else:
            raise AssertionError("no error")
    """


class CheckpointNotFound(CkptdError, FileNotFoundError):
    """No committed checkpoint exists where one was requested.

    Example:
        import tempfile
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            try:
                ckpt.load({})
            except ckptd.CheckpointNotFound as e:
                assert isinstance(e, FileNotFoundError)
                assert "no committed checkpoint" in str(e)
            else:
                raise AssertionError("no error")
    """


class StateMismatch(CkptdError, ValueError):
    """The destination state and the checkpoint disagree (keys, shapes, dtypes).

    Example:
        import tempfile
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ckpt.save({"w": torch.ones(4)}, step=1)
            destination = {"w": torch.zeros(5)}
            try:
                ckpt.load(destination)
            except ckptd.StateMismatch as e:
                assert "w" in str(e)
            else:
                raise AssertionError("no error")
            assert torch.equal(destination["w"], torch.zeros(5))  # untouched
    """


class StorageError(CkptdError, OSError):
    """A storage operation failed (e.g. ENOSPC, a refused PUT).

    Example:
        import ckptd

        try:
            raise ckptd.StorageError("s3://bucket/ckpt: PUT refused")
        except OSError as e:  # a StorageError is an OSError too
            assert isinstance(e, ckptd.CkptdError)
    """


class ForeignWriter(CkptdError):
    """Another job (or a straggler of an earlier world) writes to the same checkpoint root.

    Example:
        import ckptd

        # raised by a save of a job whose root another job has taken over (claimed by
        # its first writing Checkpointer): only one job may write to a root
        assert issubclass(ckptd.ForeignWriter, ckptd.CkptdError)
    """
