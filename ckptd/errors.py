"""The error hierarchy.

::

    CkptdError                      every error ckptd raises on purpose
    ├── CorruptCheckpoint (ValueError)        bad bytes or manifest on storage: names file + tensor
    ├── CheckpointNotFound (FileNotFoundError) no committed checkpoint where one was asked for
    ├── StateMismatch (ValueError)            the destination state does not fit the checkpoint
    ├── StorageError (OSError)                the storage refused a write/read (full disk, network)
    └── ForeignWriter                         another job or an older world writes to the same root

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
