"""Taking checkpoints in from other formats and handing them out (``docs/interop.md``).

::

    dcp_format.py          torch.distributed.checkpoint on storage: the metadata index, item reads
    dcp.py                 a DCP directory as a load source: ``load_dcp`` and the Checkpointer hook
    dcp_import.py          ``ckptd import-dcp``: a DCP directory -> a committed ckptd checkpoint
    dcp_export.py          ``ckptd export --format dcp``: a ckptd checkpoint -> a DCP directory
    safetensors_export.py  ``ckptd export --format safetensors``: Hugging Face shards + index
    source.py              reading a committed ckptd checkpoint box by box (exports)
    commands.py            the CLI subcommands

Nothing here is needed to save or load ckptd checkpoints; ``ckptd`` imports this package only
when a load is pointed at a DCP directory. Every reader streams: memory is bounded by a budget
or by the largest item of the source format, never by the size of the checkpoint.
"""

from __future__ import annotations

from ckptd.interop.dcp import is_dcp, load_dcp
from ckptd.interop.dcp_export import export_dcp
from ckptd.interop.dcp_format import UntrustedPickle
from ckptd.interop.dcp_import import import_dcp
from ckptd.interop.safetensors_export import FuseRule, export_safetensors

__all__ = [
    "FuseRule",
    "UntrustedPickle",
    "export_dcp",
    "export_safetensors",
    "import_dcp",
    "is_dcp",
    "load_dcp",
]
