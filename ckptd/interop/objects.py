"""Non-tensor objects between DCP and ckptd: DCP keeps an object whole (a tuple, a list of
scalars, bytes); ckptd keeps value leaves (``.../betas/0``, ``.../betas/1``) and records which
containers were tuples (``ckptd.manifest.values``). :func:`leaves` goes one way, :func:`fold`
the other, so a round trip gives back the same objects, by ``==`` and by type."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def leaves(name: str, obj: Any, tuples: set[str]) -> dict[str, Any]:
    """``obj`` as ckptd value leaves under ``name``, named as ``ckptd.sharding.walk`` names
    them (non-empty lists, tuples and dicts are containers; bytes are leaves); the paths of
    tuples are added to ``tuples``. Raises TypeError for what a value cannot hold."""
    if isinstance(obj, tuple):
        tuples.add(name)
    if isinstance(obj, (list, tuple)) and obj:
        items: Iterable[tuple[Any, Any]] = enumerate(obj)
    elif isinstance(obj, Mapping) and obj:
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("a dict with keys that are not strings")
        items = obj.items()
    else:
        items = ()
    if items:
        return {k: v for key, x in items for k, v in leaves(f"{name}/{key}", x, tuples).items()}
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return {name: obj}
    if isinstance(obj, (list, tuple, dict)):  # empty: a leaf, as in walk()
        return {name: type(obj)()}
    raise TypeError(f"a {type(obj).__name__}")


def fold(values: Mapping[str, Any], tuples: Iterable[str]) -> dict[str, Any]:
    """ckptd value leaves -> DCP objects, as ``dcp.save`` keeps them: a tuple whole (whatever it
    holds), a list of leaves whole; dicts (and lists holding dicts) stay split into leaves."""
    out = dict(values)
    for path in sorted(set(tuples), key=lambda p: p.count("/")):  # outermost first
        prefix = f"{path}/"
        inner = {n[len(prefix):]: v for n, v in out.items() if n.startswith(prefix)}
        if not inner or path in out:
            continue  # nothing under it (another tuple took it), or an empty tuple leaf
        for n in inner:
            del out[prefix + n]
        out[path] = _build(path, inner, set(tuples))
    while True:  # lists of scalars (and of such lists), bottom up
        kids: dict[str, list[str]] = {}
        deeper: set[str] = set()  # prefixes with grandchildren: some child is not a leaf
        for name in out:
            parts = name.split("/")
            for i in range(1, len(parts)):
                prefix = "/".join(parts[:i])
                if i == len(parts) - 1:
                    kids.setdefault(prefix, []).append(parts[-1])
                else:
                    deeper.add(prefix)
        folded = False
        for parent, ks in kids.items():
            if parent in deeper or parent in out or set(ks) != {str(i) for i in range(len(ks))}:
                continue
            out[parent] = [out.pop(f"{parent}/{i}") for i in range(len(ks))]
            folded = True
        if not folded:
            return out


def _build(path: str, inner: Mapping[str, Any], tuples: set[str]) -> Any:
    """The object whose leaves are ``inner`` (relative names), tuples where recorded."""
    heads: dict[str, dict[str, Any]] = {}
    for rel, v in inner.items():
        head, _, rest = rel.partition("/")
        heads.setdefault(head, {})[rest] = v
    kids = {h: (sub[""] if list(sub) == [""] else _build(f"{path}/{h}", sub, tuples))
            for h, sub in heads.items()}
    if set(kids) == {str(i) for i in range(len(kids))}:
        seq = [kids[str(i)] for i in range(len(kids))]
        return tuple(seq) if path in tuples else seq
    return kids
