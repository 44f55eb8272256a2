"""Non-tensor values in a manifest: JSON, plus the two Python types JSON has no word for.

A state's non-tensor leaves are JSON values, with two exceptions kept exactly:

- **bytes** (opaque per-rank blobs such as a dataloader's pickled position): stored as base64
  text and returned as ``bytes``. ckptd never looks inside them, let alone unpickles them.
- **tuples** (AdamW's ``betas``): stored as JSON lists, and the path of each recorded as a
  tuple, so that a load or an export gives a tuple back where one was saved.

On disk (format version 4) the manifest's ``types`` object maps a path to ``"bytes"`` or
``"tuple"``: a value's name (or a path inside it), or ``__local__/<rank>/<name>[/...]`` for
``ckptd.Local`` values. Paths of a missing type are plain JSON. Manifests of versions 1-3 have
no ``types`` and read as before.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from ckptd.errors import CorruptCheckpoint

BYTES = "bytes"
TUPLE = "tuple"
KINDS = (BYTES, TUPLE)


def to_json(value: Any, path: str, types: dict[str, str]) -> Any:
    """``value`` as plain JSON; the paths of its bytes and tuples are added to ``types``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        types[path] = BYTES
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, tuple):
        types[path] = TUPLE
        return [to_json(v, f"{path}/{i}", types) for i, v in enumerate(value)]
    if isinstance(value, list):
        return [to_json(v, f"{path}/{i}", types) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {k: to_json(v, f"{path}/{k}", types) for k, v in value.items()}
    return value


def from_json(value: Any, path: str, types: Mapping[str, str], where: str) -> Any:
    """The inverse of :func:`to_json`; a ``bytes`` path that is not base64 text is corrupt."""
    kind = types.get(path)
    if kind == BYTES:
        if not isinstance(value, str):
            raise CorruptCheckpoint(f"{where}: {path}: a bytes value stored as "
                                    f"{type(value).__name__}, not base64 text")
        try:
            return base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as e:
            raise CorruptCheckpoint(f"{where}: {path}: a bytes value is not base64 ({e})") from e
    if isinstance(value, list):
        items = [from_json(v, f"{path}/{i}", types, where) for i, v in enumerate(value)]
        return tuple(items) if kind == TUPLE else items
    if kind == TUPLE:
        raise CorruptCheckpoint(f"{where}: {path}: recorded as a tuple, stored as "
                                f"{type(value).__name__}")
    if isinstance(value, dict):
        return {k: from_json(v, f"{path}/{k}", types, where) for k, v in value.items()}
    return value


def checked_types(raw: Any, where: str) -> dict[str, str]:
    """The ``types`` object of a manifest: path -> ``"bytes"`` or ``"tuple"``."""
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and k and v in KINDS for k, v in raw.items()
    ):
        raise CorruptCheckpoint(f"{where}: 'types' is not an object of paths to "
                                f"{' or '.join(KINDS)}")
    return raw


def snapshot(value: Any) -> Any:
    """A copy of a value tree taken at the call (the caller may change it after); bytes and
    tuples stay what they are."""
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, Mapping):
        return {k: snapshot(v) for k, v in value.items()}
    return value


def encode(values: Mapping[str, Any], tuples: frozenset[str],
           locals_: Mapping[str, Mapping[str, Any]], local_prefix: str,
           ) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, str]]:
    """A manifest's ``values``, ``locals`` and ``types`` objects from their Python form."""
    types: dict[str, str] = {p: TUPLE for p in tuples}
    vals = {n: to_json(v, n, types) for n, v in values.items()}
    locs = {r: {n: to_json(v, f"{local_prefix}/{r}/{n}", types) for n, v in by_name.items()}
            for r, by_name in locals_.items()}
    return vals, locs, types


def decode(values: dict[str, Any], locals_: dict[str, dict[str, Any]], types: dict[str, str],
           local_prefix: str, where: str,
           ) -> tuple[dict[str, Any], frozenset[str], dict[str, dict[str, Any]]]:
    """The Python form of a manifest's ``values``, ``locals`` and ``types``: values (leaves)
    with their bytes, the paths of the tuples that held them, each rank's locals."""
    vals = {n: from_json(v, n, types, where) for n, v in values.items()}
    tuples = frozenset(p for p, k in types.items()
                       if k == TUPLE and p not in vals and not p.startswith(f"{local_prefix}/"))
    locs = {r: {n: from_json(v, f"{local_prefix}/{r}/{n}", types, where)
                for n, v in by_name.items()} for r, by_name in locals_.items()}
    return vals, tuples, locs
