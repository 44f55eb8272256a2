"""Render docs/reference.md, the API reference, from the public names' docstrings.

    python tools/apiref.py            # write docs/reference.md
    python tools/apiref.py --check    # exit 1 if docs/reference.md is out of date

What is documented: every name in ``__all__`` of the modules in ``MODULES``, and every public
method and property that a documented class defines itself (or inherits from a public ckptd
class). Docstrings are Google style: a summary line, then the sections ``Args:``,
``Returns:``, ``Raises:``, ``Attributes:`` and ``Example:``. An example is rendered as a
runnable ``python`` block, which tests/test_docs.py runs. The output depends only on the
code, so tests/test_api_reference.py can compare it with the file.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import pathlib
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference.md"

# (module, heading): each module's ``__all__`` in this order
MODULES = [
    ("ckptd", "The top level: `import ckptd`"),
    ("ckptd.data", "Data order: `ckptd.data`"),
    ("ckptd.elastic", "Elastic runs and the batch planner: `ckptd.elastic`"),
]

# a constant has no docstring: its entry says what it means
CONSTANTS = {
    "ckptd.elastic.EXIT_RESTART": "The exit code (75, `EX_TEMPFAIL`) of a worker that stops so "
                                  "that the launcher restarts the job: a peer was preempted, "
                                  "or the world changes.",
}

_HEADER = re.compile(r"^(Args|Returns|Raises|Attributes|Example|Examples):\s*$")
_NAME = r"\*{0,2}[A-Za-z_]\w*"
# ``name: text``, ``a, b: text``, ``name (int): text``
_ENTRY = re.compile(rf"^({_NAME}(?:\s*,\s*{_NAME})*)\s*(?:\([^)]*\))?:\s?(.*)$")


@dataclasses.dataclass
class Doc:
    """A parsed docstring: the free text and each section's lines (dedented)."""

    text: str
    sections: dict[str, str]

    def entries(self, section: str) -> dict[str, str]:
        """The ``name: text`` entries of an Args/Raises/Attributes section; an entry may name
        several parameters (``a, b: ...``), each then maps to the same text."""
        found = split_entries(self.sections.get(section, ""))
        return {name.lstrip("*"): text for names, text in found for name in names}


_NAMES = re.compile(rf"^{_NAME}(?:\s*,\s*{_NAME})*\s*,$")  # names going on to the next line


def split_entries(section: str) -> list[tuple[list[str], str]]:
    """``[(names, text)]`` of a section's ``name: text`` entries. An entry's names may run over
    several lines, each ending with a comma (``a, b,`` / ``c: text``); its text continues on
    the more indented lines below it."""
    out: list[tuple[list[str], str]] = []
    pending = ""
    for line in section.splitlines():
        top = bool(line) and not line[0].isspace()
        if top and _NAMES.match(line):
            pending += line.strip() + " "
            continue
        match = _ENTRY.match(pending + line) if top else None
        if match:
            pending = ""
            out.append(([n.strip() for n in match.group(1).split(",")], match.group(2).strip()))
        elif out and line.strip():
            names, text = out[-1]
            out[-1] = (names, (text + " " + line.strip()).strip())
    return out


def parse(doc: str | None) -> Doc:
    lines = (doc or "").splitlines()
    text: list[str] = []
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        header = _HEADER.match(line)
        if header:
            name = "Example" if header.group(1) == "Examples" else header.group(1)
            current = sections.setdefault(name, [])
        elif current is not None and (not line.strip() or line[0].isspace()):
            current.append(line)
        else:
            current = None
            text.append(line)
    return Doc("\n".join(text).strip(),
               {k: textwrap.dedent("\n".join(v)).strip("\n") for k, v in sections.items()})


class _Source(str):
    """An annotation written as the source spells it (``str()`` of a signature would quote
    ckptd's string annotations: ``from __future__ import annotations``)."""

    def __repr__(self) -> str:
        return str(self)


def _annotation(annotation: Any) -> Any:
    if annotation is inspect.Parameter.empty:
        return annotation
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return _Source(text)


def signature(obj: Callable[..., Any], *, drop_self: bool = False) -> str:
    """``(a: int, *, b: str | None = None) -> R``, as the source writes it."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    sig = sig.replace(parameters=[p.replace(annotation=_annotation(p.annotation))
                                  for p in params],
                      return_annotation=_annotation(sig.return_annotation))
    return str(sig)


def parameters(obj: Callable[..., Any]) -> list[str]:
    """The parameter names a caller passes (no self/cls)."""
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return []
    return [p for p in params if p not in ("self", "cls")]


@dataclasses.dataclass
class Entry:
    """One documented name: ``qualname`` (``ckptd.save``, ``ckptd.Checkpointer.load``)."""

    qualname: str
    obj: Any
    kind: str  # "function", "class", "method", "property", "constant"
    top: bool  # a module's public name (it needs an example); else a class member
    module: str  # the module whose ``__all__`` names it (or its class)

    @property
    def doc(self) -> Doc:
        if self.kind == "constant":
            return Doc("", {})
        return parse(inspect.getdoc(self.obj))


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties a class defines itself or takes from a public ckptd
    class, in definition order."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("ckptd") or klass.__name__.startswith("_"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property) and not value.__doc__:
                # an override without a docstring says what the base class's says
                doc = next((base.__dict__[name].__doc__ for base in cls.__mro__
                            if isinstance(base.__dict__.get(name), property)
                            and base.__dict__[name].__doc__), None)
                value = property(value.fget, doc=doc)
            if isinstance(value, property) or inspect.isfunction(value):
                seen.add(name)
                yield name, value


def entries() -> list[Entry]:
    out: list[Entry] = []
    for module_name, _ in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            qual = f"{module_name}.{name}"
            if inspect.ismodule(obj):
                continue
            if inspect.isclass(obj):
                out.append(Entry(qual, obj, "class", True, module_name))
                if issubclass(obj, BaseException):
                    continue
                for member, value in _members(obj):
                    kind = "property" if isinstance(value, property) else "method"
                    out.append(Entry(f"{qual}.{member}", value, kind, False, module_name))
            elif callable(obj):
                out.append(Entry(qual, obj, "function", True, module_name))
            else:
                out.append(Entry(qual, obj, "constant", True, module_name))
    return out


_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc):`(~?)([^`<]*?)\s*(<[^>]*>)?`")


def _role(match: re.Match[str]) -> str:
    tilde, text, target = match.groups()
    if tilde and not target:  # ``:class:`~ckptd.X``` shows ``X``
        text = text.rsplit(".", 1)[-1]
    return f"``{text}``"


def markdown(text: str) -> str:
    """Docstring markup as Markdown: ``:class:`~ckptd.X``` and ``:meth:`text <target>``` as
    code, double backticks as single ones."""
    return re.sub(r"``([^`]+)``", r"`\1`", _ROLE.sub(_role, text))


def _section(title: str, body: str) -> list[str]:
    return [f"**{title}**", "", markdown(body), ""]


def _entry_list(doc: Doc, section: str) -> str:
    return "\n".join(f"- {', '.join(f'`{n}`' for n in names)}: {text}"
                     for names, text in split_entries(doc.sections[section]))


def render_entry(entry: Entry) -> list[str]:
    doc = entry.doc
    depth = "###" if entry.top else "####"
    if entry.kind == "constant":
        head = f"{depth} `{entry.qualname}` = `{entry.obj!r}`"
        return [head, "", CONSTANTS[entry.qualname], ""]
    elif entry.kind == "property":
        head = f"{depth} `{entry.qualname}` (property)"
    elif entry.kind == "method":
        head = f"{depth} `{entry.qualname}{signature(entry.obj, drop_self=True)}`"
    elif entry.kind == "class" and issubclass(entry.obj, (BaseException, enum.Enum)):
        bases = ", ".join(b.__name__ for b in entry.obj.__bases__)
        word = "exception" if issubclass(entry.obj, BaseException) else "class"
        head = f"{depth} `{word} {entry.qualname}({bases})`"
    elif entry.kind == "class":
        head = f"{depth} `class {entry.qualname}{signature(entry.obj)}`"
    else:
        head = f"{depth} `{entry.qualname}{signature(entry.obj)}`"
    out = [head, ""]
    if doc.text:
        out += [markdown(doc.text), ""]
    for section in ("Args", "Attributes", "Returns", "Raises"):
        if section == "Returns" and section in doc.sections:
            out += _section(section, " ".join(doc.sections[section].split()))
        elif section in doc.sections:
            out += _section(section, _entry_list(doc, section))
    if "Example" in doc.sections:
        out += ["**Example**", "", "```python", doc.sections["Example"], "```", ""]
    return out


def render() -> str:
    out = [
        "# API reference",
        "",
        "Every public name of ckptd with its parameters, defaults, errors and an example.",
        "This page is generated from the docstrings by `python tools/apiref.py`; edit those, not",
        "this page (a test checks that it is current, and runs every example).",
        "[api.md](api.md) explains the design choices behind the surface and maps DCP's and",
        "Orbax's names to ckptd's.",
        "",
    ]
    by_module: dict[str, list[Entry]] = {}
    for entry in entries():
        by_module.setdefault(entry.module, []).append(entry)
    for module_name, heading in MODULES:
        names = [e.qualname[len(module_name) + 1:] for e in by_module[module_name] if e.top]
        out += [f"## {heading}", "", ", ".join(f"`{n}`" for n in names), ""]
        for entry in by_module[module_name]:
            out += render_entry(entry)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run `python tools/apiref.py`")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for name in [m for m in sys.modules if m == "ckptd" or m.startswith("ckptd.")]:
        del sys.modules[name]
    raise SystemExit(main(sys.argv[1:]))
