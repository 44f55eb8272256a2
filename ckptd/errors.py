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
    """Base class of every error raised by ckptd."""


class CorruptCheckpoint(CkptdError, ValueError):
    """A manifest or data file is missing, truncated, tampered with or of an unknown version."""


class CheckpointNotFound(CkptdError, FileNotFoundError):
    """No committed checkpoint exists where one was requested."""


class StateMismatch(CkptdError, ValueError):
    """The destination state and the checkpoint disagree (keys, shapes, dtypes)."""


class StorageError(CkptdError, OSError):
    """A storage operation failed (e.g. ENOSPC, a refused PUT)."""


class ForeignWriter(CkptdError):
    """Another job (or a straggler of an earlier world) writes to the same checkpoint root."""
