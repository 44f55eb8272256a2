"""The public surface is exactly API.md's names."""

import ckptd

API_NAMES = {
    "init",
    "close",
    "save_async",
    "save",
    "wait",
    "latest_step",
    "load",
    "Checkpointer",
    "SaveHandle",
    "SaveResult",
    "Phase",
    "LoadResult",
    "Shard",
    "FlatShard",
    "Fused",
    "Local",
    "CkptdError",
    "CorruptCheckpoint",
    "StateMismatch",
    # docs/api.md adds the three other errors users meet
    "CheckpointNotFound",
    "StorageError",
    "ForeignWriter",
    "on_preemption",
    "preempted",
    "elastic",
    # docs/api.md: the library function `ckptd reshard` calls
    "reshard",
    # docs/api.md, "Managing steps": list, inspect, delete; the policies
    "steps",
    "metadata",
    "delete",
    "should_save",
    "StepMetadata",
    "TensorMetadata",
    "SaveEvery",
    "KeepLast",
    "KeepEvery",
    "KeepBest",
    "KeepAny",
}


def test_all_is_exactly_the_documented_public_names():
    assert set(ckptd.__all__) == API_NAMES
    for name in API_NAMES:
        assert getattr(ckptd, name) is not None


def test_every_error_class_is_a_ckptd_error_and_inherits_its_builtin():
    import inspect

    import ckptd.errors

    builtins = {
        "CorruptCheckpoint": ValueError,
        "StateMismatch": ValueError,
        "CheckpointNotFound": FileNotFoundError,
        "StorageError": OSError,
        "ForeignWriter": None,
    }
    defined = {n for n, c in inspect.getmembers(ckptd.errors, inspect.isclass)
               if c.__module__ == "ckptd.errors" and n != "CkptdError"}
    assert defined == set(builtins)  # a new error class gets its line here and in errors.py
    for name, builtin in builtins.items():
        cls = getattr(ckptd, name)
        assert issubclass(cls, ckptd.CkptdError), name
        if builtin is not None:
            assert issubclass(cls, builtin), name
        assert name in ckptd.errors.__doc__  # the hierarchy drawn in the module docstring
    assert issubclass(ckptd.elastic.NoFeasiblePlan, ckptd.CkptdError)


def test_elastic_exports_exactly_its_documented_names():
    import pathlib

    docs = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    for name in ckptd.elastic.__all__:
        assert getattr(ckptd.elastic, name) is not None
        assert f"`{name}`" in docs, f"ckptd.elastic.{name} is exported but not in docs/api.md"


def test_import_ckptd_imports_no_torch_until_used():
    import subprocess
    import sys

    code = ("import sys, ckptd, ckptd.cli; assert 'torch' not in sys.modules, 'torch'; "
            "ckptd.Shard; assert 'torch' not in sys.modules, 'Shard is a plain description'; "
            "ckptd.Checkpointer; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_lazy_name_is_never_hidden_by_its_submodule_of_the_same_name():
    """``ckptd.manifest.merge`` is both a function and the module it lives in: loading another
    name of that module first (``find_hole``) must not leave the package's ``merge`` the module."""
    import subprocess
    import sys

    code = ("from ckptd.manifest import find_hole; from ckptd.manifest import merge; "
            "assert callable(merge), merge")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_ckptd_setting_is_read_in_config_py_alone():
    """One place for settings: no module but ``ckptd/config.py`` reads a ``CKPTD_*`` variable
    by name (a tunable, ``config.Setting``, or ``config.env_fields``)."""
    import pathlib
    import re

    package = pathlib.Path(ckptd.__file__).parent
    read = re.compile(r"""environ(?:\.get)?\s*[\[(]\s*f?["']CKPTD_|getenv\(\s*f?["']CKPTD_""")
    found = [f"{p.relative_to(package)}:{i}" for p in package.rglob("*.py")
             if p.name != "config.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if read.search(line)]
    assert found == []


def test_no_submodule_shadows_a_public_name():
    """Importing a subpackage sets it as an attribute of ``ckptd``: a package named like a public
    function (``ckptd.reshard``, ``ckptd.load``) would replace the function for everyone once
    anything imported it. Every module is imported first, in a fresh interpreter, and each public
    name must still be what its module defines."""
    import subprocess
    import sys

    code = """
import importlib, pkgutil, ckptd
for m in pkgutil.walk_packages(ckptd.__path__, "ckptd."):
    if m.name.startswith(("ckptd.integrations.", "ckptd.agent.__main__", "ckptd.cli.__main__")):
        continue  # needs a framework installed / runs a command
    importlib.import_module(m.name)
bad = [n for n, mod in ckptd._EXPORTS.items()
       if getattr(ckptd, n) is not getattr(importlib.import_module(mod), n)]
print("shadowed:", bad)
assert not bad, bad
assert callable(ckptd.reshard) and callable(ckptd.load)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
