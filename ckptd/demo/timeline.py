"""``ckptd demo``: real torchrun agents on 127.0.0.1 training through preemption and scale-up.

Each simulated node is one ``torchrun --nnodes=1:4 --nproc-per-node=1`` agent running
``integrations/torchrun/train.py``; the c10d rendezvous store is a separate process (it must
outlive any node, like a head-node service). The timeline: 3 nodes train; one is preempted
(SIGTERM to its agent, which forwards it to its worker; SIGKILL after the grace period, as a
batch system does); 2 nodes continue; a 4th node joins (3), then a 5th (4); one node is lost
outright (SIGKILL to everything on it, no warning); 3 nodes continue; the run finishes.

Each node also runs a ckptd node agent (``docs/agent.md``; its own node id, one agent directory
for the simulated machine, a job secret for the peer copies, sent as soon as a save is staged:
``CKPTD_PEER_COPY=staged``; and ``CKPTD_AGENT_MIN_BYTES=0``, since the model's few kB a rank
would otherwise be written in process): restarts read from the agents' memory, and the lost
node's part from the copy its ring successor holds.

The nodes are ``ckptd.demo.cluster``'s (and why torch 2.13 needs two settings for them).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd.data import GlobalOrder
from ckptd.demo.cluster import Cluster, DemoError, interruptible, step_reached
from ckptd.elastic.events import Incarnation, summarize
from ckptd.elastic.history import TrainingMeta, scale_up_wait_s

# ----------------------------------------------------------------------------- the demo
# The demo's planner budget: the memory model's estimate for this 19.5k-parameter model is a
# few hundred KiB, so the budget is scaled down with it. 240 KiB makes world 2 need ZeRO-2 while
# worlds 3 and 4 fit ZeRO-1 (see ``ckptd plan`` on the demo's checkpoint).
DEMO_MEM_LIMIT_GIB = 240 / 2**20
DEMO_SAMPLES, DEMO_SEED = 1000, 0  # the trainers' dataset: GlobalOrder(DEMO_SAMPLES, seed=0)


@dataclasses.dataclass(frozen=True)
class DemoResult:
    workdir: Path
    ckpt: str
    phases: list[Incarnation]
    exit_codes: dict[str, int | None]
    elapsed_s: float


def run_demo(workdir: Path, *, phase_steps: int = 40, save_every: int = 10,
             cooldown_s: float = 8.0, grace_s: float = 30.0, script: Path | None = None,
             timeout_s: float = 180.0,
             read_training: Callable[[str], dict[str, Any] | None] | None = None,
             agents: bool = True, out: Callable[[str], None] = print) -> DemoResult:
    """3 nodes → SIGTERM one (2) → a node joins (3) → another (4) → one is lost (3) → stop;
    each change once the current world has trained ``phase_steps`` steps. ``agents``: every
    node runs a ckptd node agent (restarts read from memory and peer copies).

    ``read_training(root)`` returns the latest checkpoint's training metadata (for the
    scale-up cooldown); without it, nodes join at once.
    """

    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        raise DemoError(f"{workdir} is not empty: the demo starts a new run in an empty directory")
    ckpt, stop = str(workdir / "ckpt"), workdir / "STOP"
    args = ["--ckpt", ckpt, "--steps", "1000000", "--stop-file", str(stop),
            "--save-every", str(save_every), "--ref-world", "3", "--micro-batch", "1",
            "--accum", "4", "--zero-stage", "1", "--mem-limit-gib", repr(DEMO_MEM_LIMIT_GIB),
            "--cooldown-s", str(cooldown_s), "--grace-s", str(grace_s),
            "--samples", str(DEMO_SAMPLES), "--seed", str(DEMO_SEED),
            "--sample-log", str(workdir / "samples")]
    (workdir / "samples").mkdir()
    t_start = time.time()

    def say(text: str) -> None:
        out(f"[{time.time() - t_start:6.1f}s] {text}")

    def trained(cluster: Cluster, world: int, after: float) -> None:
        first = cluster.wait_for(f"training on {world} nodes", step_reached(world, 0),
                                 timeout_s, after=after)
        say(f"training on {world} nodes from step {first['step']}")
        cluster.wait_for(f"{phase_steps} steps on {world} nodes",
                         step_reached(world, first["step"] + phase_steps), timeout_s)

    def join(cluster: Cluster) -> float:
        record = read_training(ckpt) if read_training else None
        wait = scale_up_wait_s(TrainingMeta.from_json(record), time.time()) if record else 0.0
        if wait > 0:
            say(f"scale-up cooldown: the last restart was less than {cooldown_s:g} s ago; "
                f"the new node waits {wait:.1f} s")
            time.sleep(wait)  # the cooldown itself, not a synchronisation
        t = time.time()
        say(f"node {cluster.add_node().name} starts and joins the rendezvous")
        return t

    with interruptible(), Cluster(workdir, args, script=script, grace_s=grace_s,
                                   agents=agents) as cluster:
        cluster.start_store()
        for _ in range(3):
            cluster.add_node()
        say(f"3 nodes started (rendezvous store on 127.0.0.1:{cluster.port}, files in "
            f"{workdir})")
        trained(cluster, 3, 0.0)
        victim = cluster.nodes[1]
        t_term = cluster.preempt(victim)
        say(f"SIGTERM to node {victim.name} (SIGKILL in {grace_s:g} s)")
        trained(cluster, 2, t_term)
        trained(cluster, 3, join(cluster))
        t_join = join(cluster)
        trained(cluster, 4, t_join)
        lost = cluster.alive()[1]
        t_lost = cluster.lose(lost)
        say(f"node {lost.name} is lost: SIGKILL to its trainer, torchrun agent and ckptd agent")
        trained(cluster, 3, t_lost)
        stop.touch()
        say("stop requested")
        cluster.wait_for("the end of training", lambda e: e["ev"] == "done", timeout_s)
        codes = cluster.wait_exit(timeout_s)
        events = cluster.events()
    bad = {name: c for name, c in codes.items() if c != 0 and name not in (victim.name,
                                                                          lost.name)}
    if bad:
        raise DemoError(f"agents exited with {bad}; logs in {workdir}")
    phases = exactly_once(summarize(events), events, workdir / "samples",
                          GlobalOrder(DEMO_SAMPLES, seed=DEMO_SEED))
    return DemoResult(workdir, ckpt, phases, codes, time.time() - t_start)


def exactly_once(phases: list[Incarnation], events: list[dict[str, Any]], sample_dir: Path,
                 order: GlobalOrder) -> list[Incarnation]:
    """``phases`` with ``exactly_once`` set: every step of a phase read, over all its ranks
    (the trainers' ``--sample-log`` files), exactly the samples of its positions of ``order``:
    ``[consumed - global_batch, consumed)`` from rank 0's step event. Each phase is checked
    against its own log lines and events (their time windows). Steps a lost node took with it
    (the next phase started from an earlier checkpoint and trained them again) count in the
    phase that trained them for good: the data stream the model saw is what is checked."""
    logged: list[dict[str, Any]] = []
    for f in sample_dir.iterdir():
        logged += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    out = []
    for i, p in enumerate(phases):
        t0, t1 = p.window
        last = min(p.last_step, phases[i + 1].first_step) if i + 1 < len(phases) else p.last_step
        mine: dict[int, list[int]] = {}
        for rec in logged:
            if t0 <= rec["t"] < t1:
                mine.setdefault(rec["step"], []).extend(rec["samples"])
        steps = {e["step"]: e for e in events
                 if e["ev"] == "step" and e["rank"] == 0 and t0 <= e["t"] < t1}
        ok = all(
            s in steps and sorted(mine.get(s, [])) == sorted(
                order.index(q) for q in range(steps[s]["consumed"] - steps[s]["global_batch"],
                                              steps[s]["consumed"]))
            for s in range(p.first_step + 1, last + 1))
        out.append(dataclasses.replace(p, exactly_once=ok))
    return out
