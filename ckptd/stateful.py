"""Stateful objects in the state tree: a model, an optimizer, an LR scheduler, a dataloader, or
anything with ``state_dict()`` and ``load_state_dict()``, passed as it is.

The one place that turns such objects into state trees and back (the Checkpointer and the
framework adapters use it):

- an ``nn.Module``: ``torch.distributed.checkpoint.state_dict``'s model state dict — names
  without wrapper prefixes (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``), FSDP2's
  DTensors as they are — loaded back with ``set_model_state_dict``;
- a ``torch.optim.Optimizer`` *beside the module that owns its parameters* (in the same dict):
  its state keyed by parameter name, as ``get_optimizer_state_dict`` gives it; before a load its
  state is created if it has none (a fresh optimizer can be loaded into), and
  ``set_optimizer_state_dict`` puts the loaded state back;
- anything else with both methods (an LR scheduler, a dataloader, an optimizer with no owning
  module beside it, torchtitan's containers): ``state_dict()``, then ``load_state_dict()``.

**Pairing is by parameter identity, not by key names**: an optimizer pairs with the sibling
module whose parameters include all of its own, so ``{"model": m, "optim": o}``,
``{"net": m, "adam": o, "sgd": o2}`` and two models with their optimizers in one dict all pair
without a wrapper or a naming convention. An optimizer alone is saved by parameter index (its
own ``state_dict()``), which only loads into an optimizer that already has state.

At a load every object is handed its state only after the whole load succeeded; a failed load
leaves the objects as they were (a fresh optimizer's state created for it is removed again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` is an object to call ``state_dict()``/``load_state_dict()`` on."""
    return (not isinstance(obj, type) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def state_dict(obj: Any, owner: Any = None) -> Any:
    """The state tree of one stateful object (``owner``: the module that owns an optimizer's
    parameters, for its state by parameter name)."""
    import torch
    from torch.distributed.checkpoint import state_dict as dcp

    if isinstance(obj, torch.nn.Module):
        return dcp.get_model_state_dict(obj)
    if owner is not None:
        return dcp.get_optimizer_state_dict(owner, obj)
    return obj.state_dict()


def load_state_dict(obj: Any, value: Any, owner: Any = None) -> None:
    """Give one stateful object its loaded state tree (``owner`` as in :func:`state_dict`)."""
    import torch
    from torch.distributed.checkpoint import state_dict as dcp

    if isinstance(obj, torch.nn.Module):
        dcp.set_model_state_dict(obj, value)
    elif owner is not None:
        dcp.set_optimizer_state_dict(owner, obj, value)
    else:
        obj.load_state_dict(value)


@dataclass
class Unfolded:
    """A state tree with each stateful object replaced by its state tree (:attr:`tree`; the
    state itself when it holds none), and what to do once a load into it succeeded or failed."""

    tree: Any
    _loads: list[Callable[[], None]] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def restore(self) -> None:
        """After a successful load into :attr:`tree`: the caller's containers get the loaded
        values, then each object its loaded state."""
        for step in self._loads:
            step()

    def undo(self) -> None:
        """After a failed load: remove what preparing the destination added (a fresh
        optimizer's state)."""
        for step in self._undo:
            step()


def unfold(state: Any, *, loading: bool = False) -> Unfolded:
    """``state`` with its stateful objects replaced by their state trees, in copies of the
    containers that hold them (the caller's containers are not modified). ``loading``: the
    tree is a load's destination — optimizers get their state created, and
    :meth:`Unfolded.restore` copies the loaded values back and calls the objects."""
    out = Unfolded(state)
    if not _holds_stateful(state):
        return out
    try:
        out.tree = _unfold(state, loading, out)
    except BaseException:
        out.undo()
        raise
    return out


def _holds_stateful(tree: Any) -> bool:
    if isinstance(tree, dict):
        return any(is_stateful(v) or _holds_stateful(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(is_stateful(v) or _holds_stateful(v) for v in tree)
    return False


def _owners(level: dict[Any, Any]) -> dict[Any, Any]:
    """key of each optimizer in ``level`` -> the sibling module that owns all its parameters."""
    import torch

    modules = [m for m in level.values() if isinstance(m, torch.nn.Module)]
    if not modules:
        return {}
    params = [{id(p) for p in m.parameters()} for m in modules]
    found = {}
    for key, opt in level.items():
        if isinstance(opt, torch.optim.Optimizer):
            mine = {id(p) for g in opt.param_groups for p in g["params"]}
            owner = next((m for m, ps in zip(modules, params, strict=True) if mine <= ps), None)
            if owner is not None:
                found[key] = owner
    return found


def _unfold(tree: Any, loading: bool, out: Unfolded) -> Any:
    if isinstance(tree, dict):
        items = list(tree.items())
        owners = _owners(tree)
    elif isinstance(tree, (list, tuple)):
        items, owners = list(enumerate(tree)), {}
    else:
        return tree
    copy: dict[Any, Any] = {}
    plain: list[Any] = []  # keys whose loaded values go back into the caller's container
    objects: list[Any] = []
    for key, value in items:
        if is_stateful(value):
            copy[key] = _one(value, owners.get(key), loading, out)
            objects.append(key)
        elif _holds_stateful(value):
            copy[key] = _unfold(value, loading, out)
        else:
            copy[key] = value
            plain.append(key)
    if isinstance(tree, dict):
        new: Any = copy
    elif isinstance(tree, list):
        new = [copy[i] for i in range(len(tree))]
    else:  # a tuple: its loaded values cannot go back; its objects still get their state
        new = [copy[i] for i in range(len(tree))]
        plain = []
    if loading and plain:
        def back(orig: Any = tree, new: Any = new, keys: list[Any] = plain) -> None:
            for k in keys:
                if orig[k] is not new[k]:
                    orig[k] = new[k]
        out._loads.insert(0, back)  # values first, then the objects, in tree order
    if loading:
        for k in objects:  # the loaded tree is read from the copy when the load is done
            out._loads.append(partial(_give, tree, new, k, owners.get(k)))
    return new


def _give(objects: Any, loaded: Any, key: Any, owner: Any) -> None:
    load_state_dict(objects[key], loaded[key], owner)


def _one(obj: Any, owner: Any, loading: bool, out: Unfolded) -> Any:
    """The state tree of one object (at a load, the destination to fill)."""
    fresh = loading and owner is not None and not obj.state
    value = state_dict(obj, owner)
    if fresh:  # its state was created for the load: a failed load takes it away again
        out._undo.append(obj.state.clear)
    return value


__all__ = ["Unfolded", "is_stateful", "load_state_dict", "state_dict", "unfold"]
