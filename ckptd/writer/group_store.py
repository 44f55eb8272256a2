"""A fast side channel for the commit protocol: the job's c10d store, when there is one.

Storage is the commit protocol's source of truth, but storage may be exactly what is broken
(a full disk cannot take even a small failure record), and polling it costs requests. When
``torch.distributed`` is initialised, the default process group's key-value store (torchrun's
TCPStore, or the one ``init_process_group`` made) carries two keys per save attempt:

    ckptd/<attempt>/failed      "<type>\\t<reason>" of the first failure (a rank's or the commit's)
    ckptd/<attempt>/committed   set by the coordinator once manifest.json is in place

Store operations are point-to-point requests to the store server, not collectives, so the
background save thread may use them while the training loop runs collectives. Every call is
best effort: an error (the store's host died, a store without ``check``) turns the channel off
for this process and the protocol carries on through storage alone.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ckptd")


class GroupStore:
    def __init__(self, store: Any | None) -> None:
        self._store = store

    @classmethod
    def from_process_group(cls) -> GroupStore:
        """The default process group's store, or an inert channel."""
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return cls(None)
            return cls(dist.distributed_c10d._get_default_store())
        except Exception as e:  # noqa: BLE001 - a private torch API; storage still works
            log.debug("ckptd: no store side channel: %s", e)
            return cls(None)

    @property
    def active(self) -> bool:
        return self._store is not None

    def _call(self, op: str, *args: Any) -> Any:
        if self._store is None:
            return None
        try:
            return getattr(self._store, op)(*args)
        except Exception as e:  # noqa: BLE001 - see the module docstring
            log.warning("ckptd: the c10d store stopped answering (%s); storage only from now", e)
            self._store = None
            return None

    def publish_failure(self, attempt: str, kind: str, reason: str) -> None:
        value = f"{kind}\t{reason}"
        # compare_set keeps the *first* failure (the cause, not its consequences)
        self._call("compare_set", f"ckptd/{attempt}/failed", "", value)

    def failure(self, attempt: str) -> tuple[str, str] | None:
        key = f"ckptd/{attempt}/failed"
        if not self._call("check", [key]):
            return None
        raw = self._call("get", key)
        if raw is None:
            return None
        kind, _, reason = bytes(raw).decode(errors="replace").partition("\t")
        return kind, reason

    def publish_committed(self, attempt: str) -> None:
        self._call("set", f"ckptd/{attempt}/committed", "1")

    def committed(self, attempt: str) -> bool:
        return bool(self._call("check", [f"ckptd/{attempt}/committed"]))

