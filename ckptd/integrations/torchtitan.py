"""torchtitan's checkpointer seam, implemented with ckptd.

A torchtitan job switches by configuration: ``checkpoint=CkptdCheckpointManager.Config(...)``
in its ``config_registry`` function (``docs/integrations.md``). Everything else is torchtitan's
own: its ``Trainer`` builds the manager with the model parts, optimizer and LR scheduler
containers, the dataloader and ``train_state``, and calls ``load``, ``save``,
``maybe_wait_for_staging`` and ``close`` as it does for its DCP manager.

**What is saved** is the tree torchtitan's DCP manager saves — the model's state dict flattened
at the top level, then ``optimizer``, ``lr_scheduler``, ``train_state`` and any other Stateful
by name — so ckptd names equal DCP's keys with ``/`` for ``.``: ``ckptd import-dcp`` of a
torchtitan checkpoint and ``ckptd export --format dcp`` of this one interoperate. The
dataloader's state, ``{"dp_rank_<r>": pickled bytes, "world_size": n}``, is a
``ckptd.Local`` value: saved per rank, returned as bytes (ckptd does not unpickle it;
torchtitan's dataloader does, as it does under DCP).

**Policies** map one to one: ``interval``, ``keep_latest_k`` (``keep_last``; 0 keeps all),
``exclude_from_loading``, ``load_step``, model-only loads from a step-0 checkpoint,
``last_save_model_only`` with ``export_dtype``, ``load_only``, ``initial_load_path`` (a ckptd
root, or a DCP directory read by ckptd's DCP reader with ``trust_dcp=True``) with
``initial_load_model_only``. A ``folder`` that holds torchtitan's own ``step-N`` DCP
directories and no ckptd step resumes from the newest of them (``trust_dcp=True``).

**Async modes**: ``"async"`` is ``save_async`` (returns once staged, written in the background;
the next save waits for it); ``"async_with_pinned_mem"`` is ``save_async(overlap=True)``, whose
staging torchtitan awaits in ``maybe_wait_for_staging`` just before ``optimizers.step()``. In a
launched job the node agent writes the saves (``agent=None``: ckptd's default).

**A new data-parallel degree.** The model, optimizer, LR scheduler and train state reshard to any
world size. torchtitan's dataloader refuses a position saved at another dp degree; this manager
then leaves the dataloader at its start and says so in one warning, as
``exclude_from_loading=["dataloader"]`` would.

Not supported: ``initial_load_in_hf`` and ``last_save_in_hf`` (export with
``ckptd export --format safetensors`` instead); refused when configured.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.tools import filesystem

from ckptd import stateful
from ckptd.checkpointer import Checkpointer
from ckptd.errors import CkptdError
from ckptd.interop.dcp import load_dcp
from ckptd.manifest import layout
from ckptd.sharding import Local
from ckptd.writer.handle import SaveHandle

log = logging.getLogger("ckptd.integrations.torchtitan")

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DCP_STEP = re.compile(r"step-(\d+)")
_UNSET = b"\0ckptd: not in the checkpoint\0"


class CkptdCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # torchtitan: untyped
    """torchtitan's ``BaseCheckpointManager`` with ckptd underneath (see the module's doc).

    Args:
        config: torchtitan's checkpoint configuration, with ckptd's fields (``Config``:
            ``async_mode``, ``trust_dcp``, ``agent``, ``compression``); ``folder`` is the
            ckptd root, ``keep_latest_k`` its ``keep_last``, ``load_only`` makes it read-only.
        dataloader, model_parts, optimizers, lr_schedulers, states: what torchtitan hands
            every checkpoint manager: saved and loaded as the state tree's stateful objects.
        sd_adapter: torchtitan's state-dict adapter (unused: Hugging Face export is
            ``ckptd export --format safetensors``).
        base_folder: the directory ``config.folder`` is relative to.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """"async": save_async; "async_with_pinned_mem": save_async(overlap=True)."""

        trust_dcp: bool = False
        """Read torchtitan's DCP directories (initial_load_path, step-N under folder): their
        metadata is a pickle, so only with this set."""

        agent: bool | None = None
        """The node agent writes the saves: None is ckptd's default (on in a launched job)."""

        compression: str | None = None
        """None, "zstd" or "zstd:LEVEL" (ckptd's choice when None)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"checkpoint.async_mode {self.async_mode!r}: disabled, async "
                                 "or async_with_pinned_mem")
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise ValueError("CkptdCheckpointManager reads and writes ckptd and DCP "
                                 "checkpoints; for Hugging Face use 'ckptd export --format "
                                 "safetensors' (initial_load_in_hf/last_save_in_hf unsupported)")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.save_future: SaveHandle | None = None
        self.staging: SaveHandle | None = None
        self.folder = filesystem.join(base_folder, config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.ckpt = Checkpointer(self.folder, keep_last=config.keep_latest_k,
                                 compression=config.compression, read_only=config.load_only,
                                 agent=config.agent)
        log.info("ckptd: checkpoints of %s are loaded from and saved to %s",
                 type(self).__name__, self.ckpt.url)

    def __del__(self) -> None:
        self.close()

    # -- what is saved ------------------------------------------------------------------------

    def _tree(self, model_only: bool, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        """torchtitan's flattened state: model keys at the top, each other Stateful by name."""
        tree: dict[str, Any] = dict(self.states[MODEL].state_dict())
        if model_only:
            return tree
        others = {key: obj for key, obj in self.states.items()
                  if key != MODEL and key not in exclude and obj is not None}
        tree.update(stateful.unfold(others).tree)  # each Stateful by its state_dict()
        if DATALOADER in tree:
            tree[DATALOADER] = Local(tree[DATALOADER])
        return tree

    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or step % self.config.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step and self.config.last_save_model_only:
            dtype = _DTYPES[self.config.export_dtype]
            tree = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                    else v for k, v in self._tree(model_only=True).items()}
            self.ckpt.save(tree, step=curr_step)
            return True
        tree = self._tree(model_only=False)
        mode = self.config.async_mode
        if mode == "disabled" or last_step:
            self.ckpt.save(tree, step=curr_step)
        elif mode == "async":
            self.save_future = self.ckpt.save_async(tree, step=curr_step)
        else:  # staged while the next step's forward and backward run
            self.save_future = self.staging = self.ckpt.save_async(tree, step=curr_step,
                                                                   overlap=True)
        return True

    def _maybe_wait_for_staging(self) -> None:
        if self.staging is not None:
            self.staging.wait_staged()
            self.staging = None

    def _wait_for_saving(self) -> None:
        assert self.save_future is not None
        self.save_future.result()
        self.save_future = self.staging = None

    def _close(self) -> None:
        if hasattr(self, "ckpt"):
            try:
                self.maybe_wait_for_saving()
            finally:
                self.ckpt.close()

    # -- loading ------------------------------------------------------------------------------

    def _dcp_steps(self) -> dict[int, str]:
        """torchtitan's own checkpoints under the folder: ``step-N`` with a DCP ``.metadata``."""
        if not filesystem.isdir(self.folder):
            return {}
        out = {}
        for name in filesystem.listdir(self.folder):
            found = _DCP_STEP.fullmatch(name)
            path = filesystem.join(self.folder, name)
            if found and filesystem.isfile(filesystem.join(path, layout.DCP_METADATA)):
                out[int(found.group(1))] = path
        return out

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        dcp = self._dcp_steps()
        latest = self.ckpt.latest_step()
        if step != -1:
            if step in dcp and latest is None:
                return self._from_dcp(dcp[step], model_only=step == 0)
            return self._from_ckptd(step, model_only=step == 0)
        if latest is not None:
            return self._from_ckptd(latest, model_only=latest == 0)
        if dcp:
            newest = max(dcp)
            return self._from_dcp(dcp[newest], model_only=newest == 0)
        path = self.config.initial_load_path
        if not path:
            log.info("ckptd: no checkpoint in %s: a fresh start", self.ckpt.url)
            return False
        model_only = self.config.initial_load_model_only
        if filesystem.isfile(filesystem.join(path, layout.DCP_METADATA)):
            return self._from_dcp(path, model_only)
        with Checkpointer(path, read_only=True) as source:
            found = source.latest_step()
            if found is None:
                raise CkptdError(f"checkpoint.initial_load_path {path}: neither a ckptd root "
                                 "with a committed step nor a DCP directory")
            return self._from_ckptd(found, model_only, source)

    def _from_ckptd(self, step: int, model_only: bool, source: Checkpointer | None = None,
                    ) -> bool:
        ck = source or self.ckpt
        tree = self._tree(model_only, tuple(self.config.exclude_from_loading))
        mine = tree.get(DATALOADER)
        ck.load(tree, step=step)
        if isinstance(mine, Local):  # every rank loads (a load is collective), one may use it
            values = {k: _UNSET if isinstance(v, bytes) else v for k, v in mine.value.items()}
            ck.load({DATALOADER: values}, step=step, strict=False)  # an imported DCP's keys
            if tree[DATALOADER] is mine:  # no Local saved for this rank
                tree[DATALOADER] = values
        self._apply(tree, model_only)
        log.info("ckptd: loaded step %d from %s%s", step, ck.url,
                 " (model only)" if model_only else "")
        return True

    def _from_dcp(self, path: str, model_only: bool) -> bool:
        tree = self._tree(model_only, tuple(self.config.exclude_from_loading))
        mine = tree.pop(DATALOADER, None)
        load_dcp(tree, path, trust=self.config.trust_dcp)
        if isinstance(mine, Local):
            values = {k: _UNSET if isinstance(v, bytes) else v for k, v in mine.value.items()}
            load_dcp({DATALOADER: values}, path, trust=self.config.trust_dcp, strict=False)
            tree[DATALOADER] = values
        self._apply(tree, model_only)
        log.info("ckptd: loaded torchtitan's DCP checkpoint %s%s", path,
                 " (model only)" if model_only else "")
        return True

    def _apply(self, tree: dict[str, Any], model_only: bool) -> None:
        """Hand each loaded part to its owner, as torchtitan's DCP manager does."""
        self.states[MODEL].load_state_dict(tree)
        if model_only:
            return
        for key, obj in self.states.items():
            if key == MODEL or key not in tree or obj is None:
                continue
            value = tree[key]
            if key == DATALOADER:
                value = self._dataloader_state(obj, value)
                if value is None:
                    continue
            stateful.load_state_dict(obj, value)

    @staticmethod
    def _dataloader_state(loader: Any, loaded: Any) -> dict[str, Any] | None:
        loaded = loaded.value if isinstance(loaded, Local) else loaded
        if not isinstance(loaded, dict):
            return None
        value = {str(k): v for k, v in loaded.items() if v is not _UNSET}
        mine = [k for k in value if k.startswith("dp_rank_")]
        if not mine:
            log.warning("ckptd: no dataloader position was saved for this rank; the dataloader "
                        "starts at the beginning")
            return None
        saved, now = value.get("world_size"), getattr(loader, "dp_world_size", None)
        if now is not None and saved != now:
            log.warning("ckptd: the dataloader position was saved at a data-parallel degree of "
                        "%s, this job has %s, and torchtitan's dataloader cannot reshard it: it "
                        "starts at the beginning", saved, now)
            return None
        return value


__all__ = ["CkptdCheckpointManager"]
