"""The API reference (docs/reference.md) is complete and current: every public name has an
example, every public function and method names each of its parameters under ``Args:``, and
the page is what ``tools/apiref.py`` renders from the docstrings (its examples are run by
tests/test_docs.py)."""

from __future__ import annotations

import enum
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _apiref():
    spec = importlib.util.spec_from_file_location("apiref", ROOT / "tools" / "apiref.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["apiref"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


apiref = _apiref()
ENTRIES = apiref.entries()


def test_reference_page_is_what_the_renderer_writes():
    page = ROOT / "docs" / "reference.md"
    assert page.exists(), "docs/reference.md is missing: run `python tools/apiref.py`"
    assert page.read_text() == apiref.render(), (
        "docs/reference.md is out of date: run `python tools/apiref.py`")


def test_the_reference_covers_every_public_name():
    import ckptd


    documented = {e.qualname for e in ENTRIES}
    for module in (ckptd, ckptd.data, ckptd.elastic):
        for name in module.__all__:
            if name == "elastic":
                continue
            assert f"{module.__name__}.{name}" in documented
    for member in ("load", "save", "save_async", "wait", "close", "latest_step", "open"):
        assert f"ckptd.Checkpointer.{member}" in documented
    for member in ("result", "exception", "wait_staged", "wait_safe", "phase"):
        assert f"ckptd.SaveHandle.{member}" in documented
    assert "ckptd.LoadResult.nbytes_from_storage" in documented
    page = apiref.render()  # each module's names under its own heading
    assert page.index("## The top level") < page.index("ckptd.save(") < page.index("## Data")
    assert page.index("## Data") < page.index("class ckptd.data.GlobalOrder") < page.index(
        "## Elastic") < page.index("ckptd.elastic.resume(")


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.top], ids=lambda e: e.qualname)
def test_every_public_name_has_a_summary_and_an_example(entry):
    doc = entry.doc
    if entry.kind == "constant":
        assert entry.qualname in apiref.CONSTANTS, f"{entry.qualname}: not described"
        return
    assert doc.text, f"{entry.qualname}: no docstring"
    assert doc.sections.get("Example", "").strip(), f"{entry.qualname}: no Example: section"


def _callables():
    for entry in ENTRIES:
        if entry.kind in ("function", "method") or (
                entry.kind == "class" and not issubclass(entry.obj, (BaseException, enum.Enum))):
            params = [p for p in apiref.parameters(entry.obj) if p not in ("self", "cls")]
            if params:
                yield pytest.param(entry, params, id=entry.qualname)


@pytest.mark.parametrize(("entry", "params"), list(_callables()))
def test_every_parameter_is_documented_under_args(entry, params):
    documented = entry.doc.entries("Args")
    if entry.kind == "class":  # a result's fields are its constructor's parameters
        documented |= entry.doc.entries("Attributes")
    missing = [p for p in params if p not in documented]
    assert not missing, f"{entry.qualname}: Args: does not name {missing}"


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.kind in ("method", "property")],
                         ids=lambda e: e.qualname)
def test_every_public_member_has_a_docstring(entry):
    assert entry.doc.text, f"{entry.qualname}: no docstring"


def test_docstring_sections_are_parsed():
    doc = apiref.parse("""Summary.

    More text.

    Args:
        a, b: the two.
        c: one
            continued.

    Returns:
        Something.

    Example:
        x = 1
        if x:
            print(x)
    """.replace("\n    ", "\n"))
    assert doc.text == "Summary.\n\nMore text."
    assert doc.entries("Args") == {"a": "the two.", "b": "the two.", "c": "one continued."}
    names_over_lines = apiref.parse("S.\n\nArgs:\n    a, b,\n    c: all three.\n")
    assert names_over_lines.entries("Args") == {"a": "all three.", "b": "all three.",
                                                "c": "all three."}
    assert doc.sections["Returns"] == "Something."
    assert doc.sections["Example"] == "x = 1\nif x:\n    print(x)"


def test_the_docs_name_no_file_outside_the_repository():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for outside in ("../shared", "API.md"):
            assert outside not in text, f"{page.name} names {outside!r}, outside the repository"
