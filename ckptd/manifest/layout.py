"""Where things live under a checkpoint root.

::

    ROOT/owner.json                          the run that currently writes here
    ROOT/latest                              advisory pointer: the newest committed step's dir
    ROOT/metrics.jsonl                       one line per save (rank 0)
    ROOT/step-000000042/manifest.json        the commit record
    ROOT/step-000000042/ranks/<attempt>/00003.json      rank 3's partial manifest
    ROOT/step-000000042/ranks/<attempt>/FAILED          the coordinator gave up (reason inside)
    ROOT/step-000000042/ranks/<attempt>/00003.failed    rank 3 could not do its share (why)
    ROOT/step-000000042/ranks/<attempt>/00003.handoff   rank 3's share was written by a peer's
                                                        node agent after a SIGTERM (who, when)
    ROOT/step-000000042/data/<attempt>/r00003-0.bin     rank 3's first data file
    ROOT/step-000000042/data/<attempt>/r00003.frames    rank 3's frame table (format 3)

Data and partials live under the save *attempt* id, so two attempts at the same step (a retry,
a straggler of an earlier world, another job) never write the same file.
"""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
LATEST = "latest"
OWNER = "owner.json"
# Not ckptd's: the index of a torch.distributed.checkpoint directory, which a root or a
# ``source=`` may be (ckptd/interop loads it).
DCP_METADATA = ".metadata"
METRICS = "metrics.jsonl"
FAILED = "FAILED"

_STEP_RE = re.compile(r"^step-(\d{9,})$")


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def manifest_path(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def partials_dir(step: int, attempt: str) -> str:
    return f"{step_dir(step)}/ranks/{attempt}"


def partial_path(step: int, attempt: str, rank: int) -> str:
    return f"{partials_dir(step, attempt)}/{rank:05d}.json"


def failed_path(step: int, attempt: str) -> str:
    return f"{partials_dir(step, attempt)}/{FAILED}"


def is_partial(name: str) -> bool:
    return name.endswith(".json") and name[:-5].isdigit()


def rank_failed_path(step: int, attempt: str, rank: int) -> str:
    return f"{partials_dir(step, attempt)}/{rank:05d}.failed"


def is_rank_failure(name: str) -> bool:
    return name.endswith(".failed") and name[:-7].isdigit()


def parse_rank_failure(name: str) -> int:
    return int(name[:-7])


def handoff_path(step: int, attempt: str, rank: int) -> str:
    return f"{partials_dir(step, attempt)}/{rank:05d}.handoff"


def is_handoff(name: str) -> bool:
    return name.endswith(".handoff") and name[:-8].isdigit()


def data_file(attempt: str, rank: int, index: int) -> str:
    """Relative to the step directory (that is how manifests name data files)."""
    return f"data/{attempt}/r{rank:05d}-{index}.bin"


def frame_table(attempt: str, rank: int) -> str:
    """Relative to the step directory, like :func:`data_file`."""
    return f"data/{attempt}/r{rank:05d}.frames"
