"""What a Hugging Face export needs besides tensors, so that ``from_pretrained`` cannot load
garbage silently: which tensors are the model's, the names it expects, and ``config.json``.

- **Model tensors by default.** A checkpoint of ``{"model": ..., "optim": ...}`` exports
  ``model/*`` with ``model/`` stripped; one with the model at the top (torchtitan's) exports
  every tensor but those of optimizer, scheduler, dataloader and per-rank state.
- **Wrapper segments** that training wrappers add to parameter names — ``_orig_mod``
  (``torch.compile``), ``module`` (DDP), ``_checkpoint_wrapped_module`` (activation
  checkpointing), ``_fsdp_wrapped_module`` (FSDP1) — are removed wherever they appear.
- **A rename hook** maps each output name (after the above) for a framework's own naming: a
  callable, a mapping, ``"module:function"`` or the path of a JSON object file.
- **config.json** comes from a file or a model directory; an export without one is refused.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptd.errors import CkptdError

WRAPPERS = ("_orig_mod", "module", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
NOT_MODEL = ("optim", "optimizer", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler",
             "dataloader", "train_state", "__local__", "rng", "step")
CONFIG = "config.json"
Rename = Callable[[str], str] | Mapping[str, str] | str


def model_selection(names: Sequence[str]) -> tuple[list[str], str]:
    """Default ``select`` globs and ``strip_prefix`` for the model's tensors."""
    if any(n.startswith("model/") for n in names):
        return ["model/*"], "model/"
    kept = sorted({n.split("/", 1)[0] for n in names} - set(NOT_MODEL))
    return kept + [f"{k}/*" for k in kept], ""


def strip_wrappers(name: str) -> str:
    """``name`` without wrapper segments (``_orig_mod.layers.0.x`` -> ``layers.0.x``)."""
    return ".".join(p for p in name.split(".") if p not in WRAPPERS)


def rename_function(rename: Rename | None) -> Callable[[str], str]:
    """The rename hook as a function (identity without one)."""
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda name: table.get(name, name)
    if ":" in rename and not rename.endswith(".json"):
        module, _, attr = rename.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise CkptdError(f"--rename {rename}: {type(e).__name__}: {e}") from e
        if not callable(fn):
            raise CkptdError(f"--rename {rename}: not a callable")
        return fn  # type: ignore[no-any-return]
    try:
        with open(rename, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise CkptdError(f"--rename {rename}: not a readable JSON file ({e})") from e
    if not (isinstance(table, dict) and all(isinstance(v, str) for v in table.values())):
        raise CkptdError(f"--rename {rename}: want a JSON object of name -> new name")
    return lambda name: table.get(name, name)


def config_bytes(config: str | Mapping[str, Any] | None, config_from: str | None,
                 no_config: bool) -> bytes | None:
    """The ``config.json`` to write, or None with ``no_config``; refused when there is none."""
    if config is not None and config_from is not None:
        raise CkptdError("give --config or --config-from, not both")
    if config is None and config_from is None:
        if no_config:
            return None
        raise CkptdError("refusing to export for Hugging Face without config.json "
                         "(from_pretrained would build a default model, not this one): pass "
                         "--config FILE or --config-from MODEL_DIR, or --no-config")
    if isinstance(config, Mapping):
        doc: Any = dict(config)
    else:
        path = config if config is not None else f"{str(config_from).rstrip('/')}/{CONFIG}"
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise CkptdError(f"{path}: not a readable config.json ({e})") from e
    if not isinstance(doc, dict):
        raise CkptdError(f"the model config is a {type(doc).__name__}, not a JSON object")
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
