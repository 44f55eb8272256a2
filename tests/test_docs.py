"""Every ```python block of the README and docs/ runs (in a temporary working directory)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)

CASES = [
    pytest.param(code, id=f"{path.name}:{i}")
    for path in DOCS
    for i, code in enumerate(BLOCK.findall(path.read_text()))
]


@pytest.mark.parametrize("code", CASES)
def test_documentation_example_runs(code, tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    # the examples show what a user gets: small saves written in process where an agent runs
    monkeypatch.delenv("CKPTD_AGENT_MIN_BYTES", raising=False)
    environ = dict(os.environ)  # what an example sets is undone after it
    import ckptd.checkpointer

    try:
        exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_example__"})
    finally:
        os.environ.clear()
        os.environ.update(environ)
        default = ckptd.checkpointer.default_or_none()
        if default is not None:
            default.close()
            ckptd.checkpointer.set_default(None)
