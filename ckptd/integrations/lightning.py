"""Lightning's ``CheckpointIO`` plugin, implemented with ckptd.

A Lightning job switches with one plugin: ``Trainer(plugins=[CkptdCheckpointIO()])`` (or
``Fabric(plugins=[...])``); ``ModelCheckpoint``, ``ckpt_path="last"``, ``fabric.save`` and
``fabric.load`` keep working as they are (``docs/integrations.md``).

**Where a checkpoint goes.** Each path Lightning names (``checkpoints/epoch=1-step=8.ckpt``,
``last.ckpt``) is a ckptd root, a directory; the checkpoint is its step ``global_step``. Saving
the same path again (``last.ckpt``) commits a new step there and drops the older one, so a kill
mid-save leaves the previous checkpoint whole. ``ckptd ls``, ``inspect``, ``verify`` and
``export`` take the path as they take any root.

**What is saved.** Lightning's checkpoint dict as ckptd's tree: tensors as tensors (the model's
``state_dict``, each optimizer's state, tensors inside callbacks' states), the rest (epoch,
global_step, loops, LR schedulers, callbacks, hyper-parameters) as the manifest's JSON values,
bytes as bytes, tuples as tuples, dict keys with their type (an optimizer's ``state`` is keyed by
int). A value JSON cannot hold (an ``argparse.Namespace`` among the hyper-parameters) is refused,
naming its key, unless ``allow_pickle=True``: then it is pickled into bytes and unpickled on load
(with the same option only). ckptd never unpickles otherwise.

**Who calls it.** Lightning's strategies save through the plugin on global rank 0 alone (the
state is replicated: DDP, single device), and remove on rank 0; every rank loads. The plugin
therefore runs ckptd as a world of one process (:func:`ckptd.world.alone`): no collective ever
waits for a rank that is not calling. Every rank loads the whole checkpoint, as ``torch.load``
would, so a job resumes at any process count.

**Async.** ``async_save=True`` is ckptd's ``save_async``: ``save_checkpoint`` returns once the
state is staged in host memory, the write and commit go on in the background, the next save to
any path waits for it, and ``teardown`` (the end of ``fit``) drains it; :meth:`wait` waits
earlier. Lightning's own ``AsyncCheckpointIO(CkptdCheckpointIO())`` works too (a thread runs the
whole save).

**Sharded strategies.** Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy`` with sharded
state dicts write torch.distributed.checkpoint directories themselves and never call a
``CheckpointIO``; those directories load through ckptd's DCP reader (``ckptd import-dcp``,
``ckptd.load(state, source=DIR, trust=True)``). With ``state_dict_type="full"`` they hand full
tensors to this plugin on rank 0, saved as above. A DTensor handed to the plugin (rank 0 alone
holds only its shard) is refused in one line.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Mapping
from typing import Any

import fsspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ckptd.checkpointer import Checkpointer
from ckptd.errors import CkptdError
from ckptd.world import alone

log = logging.getLogger("ckptd.integrations.lightning")

# The training metadata key that holds the checkpoint's shape: containers, key types, and the
# kind of each leaf; what load_checkpoint rebuilds Lightning's dict from.
SHAPE = "lightning"
_JSON = (type(None), bool, int, float, str)


class CkptdCheckpointIO(CheckpointIO):  # type: ignore[misc]  # lightning: untyped base
    """Lightning's ``CheckpointIO`` with ckptd underneath (see the module's doc).

    Args:
        async_save: ``save_checkpoint`` returns once the state is staged; the write and
            commit go on in the background (``save_async``).
        keep_last: committed steps kept under each path (1: the checkpoint Lightning asked
            for; 0 keeps all).
        compression: as ``Checkpointer(compression=)``: None, ``"zstd[:LEVEL]"`` or ``"auto"``.
        storage_options: options for the storage backend (fsspec's, s3fs's).
        allow_pickle: pickle the values JSON cannot hold (an ``argparse.Namespace`` among the
            hyper-parameters) and unpickle them on load; without it they are refused, named.
        agent: hand the writes to the node agent; None: ckptd's default (on in a launched
            job).

    >>> trainer = Trainer(plugins=[CkptdCheckpointIO(async_save=True)])   # doctest: +SKIP
    """

    def __init__(self, *, async_save: bool = False, keep_last: int = 1,
                 compression: str | None = None, storage_options: dict[str, Any] | None = None,
                 allow_pickle: bool = False, agent: bool | None = None) -> None:
        """``keep_last``: committed steps kept under each path (1: the checkpoint Lightning
        asked for; 0 keeps all). ``agent``: hand the writes to the node agent (ckptd's
        default: on in a launched job). ``storage_options`` go to fsspec."""
        self.async_save = async_save
        self.keep_last = keep_last
        self.compression = compression
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.agent = agent
        self._open: dict[str, Checkpointer] = {}
        self._lock = threading.Lock()  # AsyncCheckpointIO calls from its thread

    # -- saving -------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        root = str(path)
        options = self._options(storage_options)
        tree, shape = flatten(checkpoint, self.allow_pickle)
        step = checkpoint.get("global_step", 0)
        step = step if isinstance(step, int) and step >= 0 else 0
        training = {SHAPE: shape, "epoch": checkpoint.get("epoch"), "global_step": step}
        with self._lock, alone():
            for other in [p for p in self._open if p != root]:  # one save in flight at a time
                self._open.pop(other).close()
            ckpt = self._open.get(root)
            if ckpt is None:
                ckpt = self._open[root] = Checkpointer(
                    root, rank=0, world_size=1, keep_last=self.keep_last,
                    compression=self.compression, storage_options=options, agent=self.agent)
            if self.async_save:
                ckpt.save_async(tree, step=step, training=training, overwrite=True)
            else:
                ckpt.save(tree, step=step, training=training, overwrite=True)

    def wait(self) -> None:
        """Block until every save is committed; raise a background error."""
        with self._lock, alone():
            for ckpt in self._open.values():
                ckpt.wait()

    def teardown(self) -> None:
        with self._lock, alone():
            while self._open:
                self._open.popitem()[1].close()

    def remove_checkpoint(self, path: Any) -> None:
        root = str(path)
        with self._lock, alone():
            ckpt = self._open.pop(root, None)
            if ckpt is not None:
                ckpt.close()
        fs, where = fsspec.core.url_to_fs(root, **(self.storage_options or {}))
        if fs.exists(where):
            fs.rm(where, recursive=True)
            log.debug("ckptd: removed checkpoint %s", root)

    # -- loading ------------------------------------------------------------------------------

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        root = str(path)
        fs, where = fsspec.core.url_to_fs(root, **(self.storage_options or {}))
        if fs.isfile(where):
            raise CkptdError(f"{root}: a file, not a ckptd root (torch.save's? Lightning's "
                             "TorchCheckpointIO reads it)")
        with self._lock:
            pending = self._open.get(root)
        if pending is not None:  # this process's own save to it may still be in flight
            with alone():
                pending.wait()
        with alone(), Checkpointer(root, rank=0, world_size=1, read_only=True,
                                   storage_options=self.storage_options) as ckpt:
            step = ckpt.latest_step()
            if step is None:
                raise CkptdError(f"{root}: no committed ckptd checkpoint; CkptdCheckpointIO "
                                 "saves each checkpoint path as a ckptd root")
            shape = ckpt.read_manifest(step).training.get(SHAPE)
            if not isinstance(shape, dict):
                raise CkptdError(f"{root}: step {step} was not saved by CkptdCheckpointIO (no "
                                 f"'{SHAPE}' in its training metadata)")
            tree = template(shape, f"{root} step {step}")
            ckpt.load(tree, step=step)
        out = unflatten(tree, shape, self.allow_pickle and weights_only is not True, root)
        if map_location is not None:
            out = _to(out, map_location, root)
        return out  # type: ignore[no-any-return]

    def _options(self, given: Any) -> dict[str, Any] | None:
        if given is None:
            return self.storage_options
        if not isinstance(given, Mapping):
            raise TypeError(f"CkptdCheckpointIO: storage_options is fsspec's options (a dict), "
                            f"not {type(given).__name__}")
        return {**(self.storage_options or {}), **given}


# -- Lightning's dict <-> ckptd's tree --------------------------------------------------------
#
# A shape is JSON: {"d": [[key, key type, tree key, shape], ...]} for a dict, {"l": [...]} and
# {"t": [...]} for a list and a tuple, {"x": [dims, dtype]} for a tensor, "v" for a JSON or
# bytes value and "p" for pickled bytes. A tree key is the dict key itself when it is a str
# ckptd can use as a name segment, else "~<i>" (an int key, a file path with "/" among
# ModelCheckpoint's best_k_models).

_KEY_TYPES: dict[type, str] = {str: "s", int: "i", float: "f", bool: "b", type(None): "n"}


def flatten(obj: Any, allow_pickle: bool, where: str = "") -> tuple[Any, Any]:
    """Lightning's checkpoint as ckptd's tree, and the shape that rebuilds it."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise CkptdError(f"{where}: a {type(obj).__name__} handed to CkptdCheckpointIO on "
                             "rank 0 alone; a sharded strategy's state must go through "
                             "torch.distributed.checkpoint or ckptd.save on every rank")
        return obj.detach(), {"x": [list(obj.shape), str(obj.dtype).removeprefix("torch.")]}
    if isinstance(obj, Mapping):
        tree: dict[str, Any] = {}
        items = []
        for i, (key, value) in enumerate(obj.items()):
            kind = _KEY_TYPES.get(type(key))
            if kind is None:
                raise CkptdError(f"{where or '<top>'}: a dict key of type {type(key).__name__} "
                                 f"({key!r}); CkptdCheckpointIO keeps str, int, float, bool and "
                                 "None keys")
            usable = kind == "s" and key and "/" not in key and not key.startswith("~")
            name = key if usable else f"~{i}"
            tree[name], shape = flatten(value, allow_pickle, f"{where}/{key}".lstrip("/"))
            items.append([key, kind, name, shape])
        return tree, {"d": items}
    if isinstance(obj, (list, tuple)):
        pairs = [flatten(v, allow_pickle, f"{where}/{i}") for i, v in enumerate(obj)]
        return [p[0] for p in pairs], {"t" if isinstance(obj, tuple) else "l": [p[1] for p in
                                                                                   pairs]}
    if isinstance(obj, (*_JSON, bytes)):
        return obj, "v"
    if not allow_pickle:
        raise CkptdError(f"{where}: a {type(obj).__name__} is neither a tensor nor JSON-able; "
                         "CkptdCheckpointIO pickles it only with allow_pickle=True")
    return pickle.dumps(obj), "p"


def template(shape: Any, where: str) -> Any:
    """A destination tree for ``shape``: empty tensors of the saved shapes and dtypes, None for
    each value (``Checkpointer.load`` fills both)."""
    if shape in ("v", "p"):
        return None
    if isinstance(shape, dict) and len(shape) == 1:
        (kind, items), = shape.items()
        if kind == "x":
            dims, dtype = items
            return torch.empty(dims, dtype=getattr(torch, dtype))
        if kind == "d":
            return {name: template(sub, where) for _, _, name, sub in items}
        if kind in ("l", "t"):
            return [template(sub, where) for sub in items]
    raise CkptdError(f"{where}: the '{SHAPE}' training metadata is not a CkptdCheckpointIO shape")


def unflatten(tree: Any, shape: Any, unpickle: bool, where: str, path: str = "") -> Any:
    """Lightning's dict from ckptd's loaded tree and its shape."""
    if shape == "p":
        if not unpickle:
            raise CkptdError(f"{where}: {path} was pickled at save; load it with "
                             "CkptdCheckpointIO(allow_pickle=True) (and weights_only not True)")
        return pickle.loads(tree)
    if not isinstance(shape, dict) or "x" in shape:
        return tree
    (kind, items), = shape.items()
    if kind == "d":
        return {_key(key, k): unflatten(tree[name], sub, unpickle, where, f"{path}/{key}")
                for key, k, name, sub in items}
    out = [unflatten(t, sub, unpickle, where, f"{path}/{i}")
           for i, (t, sub) in enumerate(zip(tree, items, strict=True))]
    return tuple(out) if kind == "t" else out


def _key(key: Any, kind: str) -> Any:
    return {"i": int, "f": float}.get(kind, lambda k: k)(key)


def _to(obj: Any, device: Any, where: str) -> Any:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{where}: CkptdCheckpointIO's map_location is a device (str or "
                        f"torch.device), not {type(device).__name__}")
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device, where) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_to(v, device, where) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


__all__ = ["CkptdCheckpointIO"]
