"""``Buffer``: the bytes-like values that storage reads and writes and the codecs encode.

At the bottom of the layers so that the format (``ckptd.manifest``), which does no I/O, names
the type without importing storage.
"""

from __future__ import annotations

Buffer = bytes | bytearray | memoryview
