"""The configuration is honest: every Checkpointer parameter is documented in its docstring,
``ckptd.init`` and the module functions take what the Checkpointer takes, and a parameter
cannot be changed after construction without a word."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import ckptd


def _args_section(doc: str) -> str:
    """The ``Args:`` block of a Google-style docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Args:")
    block = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        block.append(line)
    return "\n".join(block)


def _parameters(fn: object, skip: tuple[str, ...] = ("self",)) -> dict[str, object]:
    return {n: (p.kind, p.default) for n, p in inspect.signature(fn).parameters.items()  # type: ignore[arg-type]
            if n not in skip}


def test_the_checkpointer_docstring_documents_every_constructor_parameter():
    names = _parameters(ckptd.Checkpointer)
    assert len(names) >= 15
    args = _args_section(ckptd.Checkpointer.__doc__ or "")
    documented = set(re.findall(r"^    (\w+):", args, re.M))
    assert documented == set(names), (set(names) - documented, documented - set(names))
    # what help() shows is that docstring
    import pydoc
    text = pydoc.render_doc(ckptd.Checkpointer, renderer=pydoc.plaintext)
    assert "host_budget_bytes: the most host memory" in text


def test_init_takes_every_checkpointer_parameter_with_the_same_default():
    init = inspect.signature(ckptd.init).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in init.values())
    assert _parameters(ckptd.init) == _parameters(ckptd.Checkpointer)
    for name in _parameters(ckptd.Checkpointer):
        assert name in (ckptd.init.__doc__ or ""), name


@pytest.mark.parametrize("name", ["save", "save_async", "load"])
def test_module_functions_take_what_the_methods_take(name):
    assert _parameters(getattr(ckptd, name)) == _parameters(getattr(ckptd.Checkpointer, name))


def test_module_save_overwrites_when_asked_and_close_forgets_the_default(tmp_path):
    ckptd.init(str(tmp_path), keep_last=0)
    try:
        ckptd.save({"w": torch.ones(8)}, step=1)
        with pytest.raises(ckptd.CkptdError, match="already committed"):
            ckptd.save({"w": torch.full((8,), 2.0)}, step=1)
        ckptd.save_async({"w": torch.full((8,), 3.0)}, step=1, overwrite=True).result()
        ckptd.save({"w": torch.full((8,), 4.0)}, step=2, urgent=True)
        dst = {"w": torch.zeros(8)}
        assert ckptd.load(dst, step=1).step == 1
        assert torch.equal(dst["w"], torch.full((8,), 3.0))
    finally:
        ckptd.close()
    with pytest.raises(ckptd.CkptdError, match="ckptd.init"):
        ckptd.latest_step()
    ckptd.close()  # nothing to close: nothing happens


def test_a_parameter_cannot_be_changed_after_construction(tmp_path):
    with ckptd.Checkpointer(str(tmp_path), keep_last=2) as c:
        for name, value in [("keep_last", 5), ("max_inflight", 4), ("compression", "zstd"),
                            ("rank", 1), ("url", "s3://b/x")]:
            with pytest.raises(AttributeError, match=f"Checkpointer.{name} is fixed at "
                                                     "construction"):
                setattr(c, name, value)
        assert c.keep_last == 2
        for step in range(4):
            c.save({"w": torch.full((4,), float(step))}, step=step)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000002",
                                                               "step-000000003"]
