"""The node agent's wire form of a save job (:class:`ckptd.writer.job.SaveJob`): what the
trainer sends after it staged an arena in the agent's shared memory, and what the agent
rebuilds over its own mapping of the same memory — JSON (names, boxes, arena offsets, the
codec, the framing, the commit's parameters; never tensor data, never a pickle). Every offset is
checked against the arena on the way in: a job that points outside it is refused, not followed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ckptd import policies
from ckptd.errors import CkptdError
from ckptd.hostarray import HostArray
from ckptd.manifest import TensorEntry, layout
from ckptd.manifest import values as typed
from ckptd.manifest.schema import dtype_from_name, dtype_name
from ckptd.policies import KeepLast, Retention
from ckptd.regions import Box
from ckptd.sharding import LOCAL_PREFIX, Piece
from ckptd.writer.files import Framing
from ckptd.writer.job import CommitParams, SaveJob
from ckptd.writer.pack import FilePlan, Slot
from ckptd.writer.pipeline import Round, Share

VERSION = 1


def incarnation_of(commit_doc: dict[str, Any]) -> str:
    """A job's ``commit`` entry: its incarnation (a trainer that sends none: the run id)."""
    return str(commit_doc.get("incarnation") or commit_doc["run_id"])


def encode(job: SaveJob) -> dict[str, Any]:
    """The job: everything the agent needs to write it as the saving process would have —
    the plan, the codec and the framing, the commit's parameters (never tensor data)."""
    share, rnd, framing, commit_ = job.share, job.round, job.framing, job.commit
    values, by_rank, types = typed.encode(share.values, share.tuples,
                                          {str(share.rank): share.locals}, LOCAL_PREFIX)
    locals_ = by_rank[str(share.rank)]
    return {
        "version": VERSION,
        "share": {
            "step": share.step, "attempt": share.attempt, "rank": share.rank,
            "world_size": share.world_size,
            "declared": {n: [dtype_name(e.dtype), list(e.shape)]
                         for n, e in share.declared.items()},
            "values": values, "locals": locals_, "types": types, "training": share.training,
            "replicas": share.replicas,
        },
        "nbytes": rnd.nbytes,
        "files": [{"index": p.index, "start": p.start, "end": p.end,
                   "slots": [[s.piece.name, list(s.piece.box.offsets), list(s.piece.box.sizes),
                              s.offset, s.nbytes] for s in p.slots]} for p in rnd.plans],
        "codec": job.codec, "level": job.level, "frame_bytes": framing.frame_bytes,
        "framing": {"min_frame_bytes": framing.min_frame_bytes,
                    "frames_per_chunk": framing.frames_per_chunk},
        "commit": {"run_id": commit_.run_id, "generation": commit_.generation,
                   "overwrite": commit_.overwrite, "keep_last": _keep_last(commit_.retention),
                   "retention": (None if commit_.retention is None
                                 else commit_.retention.to_json()),
                   "incarnation": commit_.incarnation, "timeout_s": commit_.timeout_s},
    }


def _replicas(doc: Any) -> dict[str, int]:
    """A share's copies per tensor (a trainer that sends none: its partial names what its
    rank holds)."""
    if not isinstance(doc, dict) or not all(
            isinstance(n, str) and type(r) is int and r > 1 for n, r in doc.items()):
        raise CkptdError(f"agent job: 'replicas' is not a map of names to copies: {doc!r}")
    return dict(doc)


def decode(doc: dict[str, Any], arena: torch.Tensor) -> SaveJob:
    """The job ``doc`` describes, its pieces viewing ``arena`` (the staged bytes). Every offset
    is checked against the arena: a job that points outside it is refused, not followed."""
    if doc.get("version") != VERSION:
        raise CkptdError(f"agent job version {doc.get('version')!r}, expected {VERSION}")
    s = doc["share"]
    declared = {n: TensorEntry(dtype_from_name(d, n), tuple(int(x) for x in shape))
                for n, (d, shape) in s["declared"].items()}
    # the pieces view the arena through numpy (:class:`HostArray`), not torch: the writer only
    # reads their bytes, and every torch call releases and takes back the GIL — with a node's
    # jobs arriving together, a wait for it each time (three calls a slot)
    host = HostArray(arena.numpy(), "uint8")
    plans = []
    for f in doc["files"]:
        slots = []
        for name, offsets, sizes, offset, nbytes in f["slots"]:
            entry = declared.get(name)
            if entry is None:
                raise CkptdError(f"agent job: slot for undeclared tensor {name!r}")
            itemsize = entry.dtype.itemsize
            if (nbytes != math.prod(sizes) * itemsize or offset < 0 or offset % itemsize
                    or offset + nbytes > arena.numel()):
                raise CkptdError(f"agent job: slot of {name!r} at {offset}+{nbytes} does not "
                                 f"fit its box or the {arena.numel()}-byte arena")
            dtype = dtype_name(entry.dtype)
            view = host[offset: offset + nbytes].view(dtype).view(tuple(sizes))
            box = Box(tuple(offsets), tuple(sizes))
            slots.append(Slot(Piece(name, entry.shape, dtype, box, view), offset, nbytes))
        plans.append(FilePlan(f["index"], f["start"], f["end"], slots))
    values, tuples, by_rank = typed.decode(
        s["values"], {str(s["rank"]): s["locals"]},
        typed.checked_types(s.get("types", {}), "agent job"), LOCAL_PREFIX, "agent job")
    share = Share(s["step"], s["attempt"], s["rank"], s["world_size"], declared,
                  values, by_rank[str(s["rank"])], s["training"], tuples,
                  _replicas(s.get("replicas", {})))
    c, f = doc["commit"], doc.get("framing") or {}
    cfg = Framing.current()  # (a job without them: this process's)
    framing = Framing(_positive(doc.get("frame_bytes", cfg.frame_bytes), "frame_bytes"),
                      _positive(f.get("min_frame_bytes", cfg.min_frame_bytes), "min_frame_bytes"),
                      _positive(f.get("frames_per_chunk", cfg.frames_per_chunk),
                                "frames_per_chunk"))
    timeout = c.get("timeout_s")
    return SaveJob(share, Round(plans, int(doc["nbytes"])), doc["codec"], int(doc["level"]),
                   framing, CommitParams(c["run_id"], int(c["generation"]), bool(c["overwrite"]),
                                   _retention(c), incarnation_of(c),
                                   None if timeout is None else float(timeout)))


def _keep_last(policy: Retention | None) -> int:
    """``keep_last`` for an agent that reads no ``retention`` (an older one): the policy's
    ``n`` when it is KeepLast, else 0 (keep every step: never one the policy keeps)."""
    return policy.n if isinstance(policy, KeepLast) else 0


def _retention(commit_doc: dict[str, Any]) -> Retention | None:
    """A job's retention: its ``retention`` policy, or (a trainer that sends none) its
    ``keep_last``."""
    if "retention" in commit_doc:
        doc = commit_doc["retention"]
        try:
            return None if doc is None else policies.from_json(doc)
        except (ValueError, TypeError) as e:
            raise CkptdError(f"agent job: {e}") from None
    keep_last = int(commit_doc["keep_last"])
    return KeepLast(keep_last) if keep_last > 0 else None


def _positive(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CkptdError(f"agent job: {name} {value!r} is not a positive integer")
    return value


def file_ranges(job: SaveJob) -> dict[str, tuple[int, int]]:
    """Each data file of the job (its path under the root) and its bytes' range in the arena:
    with the raw codec, the file itself."""
    share = job.share
    step_dir = layout.step_dir(share.step)
    return {f"{step_dir}/{layout.data_file(share.attempt, share.rank, p.index)}": (p.start, p.end)
            for p in job.round.plans}




__all__ = ["VERSION", "decode", "encode", "file_ranges", "incarnation_of"]
