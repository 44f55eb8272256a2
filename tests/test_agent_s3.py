"""The node agent with an S3 root (a real S3 server, moto, on 127.0.0.1): the agent opens the
root from the URL and options its trainer gives it, commits there without the trainer, and a
restart reads the step from the agent's memory, not from S3.

(Until the session kept the arenas its jobs still used, a step committed after its trainer
died was kept under a removed name: the restart read it from storage. Not S3's doing; this is
where it showed.)"""

from __future__ import annotations

import os
import signal

import torch
from agent_procs import fork_ranks, reap, wait_until

import ckptd
from ckptd.agent import wire

N = 1 << 20  # 4 MiB of float32


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(N, generator=g), "b": torch.full((8,), float(step))}


def _trainer(url: str, options: dict, conn) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    c = ckptd.Checkpointer(url, rank=0, world_size=1, storage_options=options, agent=True,
                           keep_last=0, run_id="first")
    assert c.executor == "agent", "no agent"
    c.save(_state(1), step=1)
    c.save_async(_state(2), step=2)  # the agent holds it; this process is killed right after
    conn.send("returned")
    conn.recv()


def _latest(url: str, options: dict) -> int | None:
    with ckptd.Checkpointer(url, rank=0, world_size=1, storage_options=options,
                            read_only=True) as c:
        return c.latest_step()


def test_an_s3_save_survives_its_trainer_and_the_restart_reads_the_agent_s_memory(
        s3_bucket, agents):
    url, options = s3_bucket.url, s3_bucket.storage_options
    procs = fork_ranks(_trainer, lambda rank: (url, options), 1)
    try:
        p, conn = procs[0]
        assert conn.poll(120), "the trainer did not reach its last save"
        assert conn.recv() == "returned"
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        try:
            wait_until(lambda: _latest(url, options) == 2, 60, "step 2 to commit on S3")
        except AssertionError as e:
            raise AssertionError(f"{e}; the agent's log:\n{agents.log()[-3000:]}") from None
    finally:
        reap(procs)
    keys = [o["Key"] for o in s3_bucket.client().list_objects_v2(
        Bucket=s3_bucket.bucket, Prefix=f"{s3_bucket.prefix}/step-000000002/")["Contents"]]
    assert any(k.endswith("manifest.json") for k in keys), keys

    dst = {"w": torch.zeros(N), "b": torch.zeros(8)}
    with ckptd.Checkpointer(url, rank=0, world_size=1, storage_options=options, agent=True,
                            run_id="restart") as c:  # the restarted job, same node
        r = c.load(dst)
    assert r.step == 2 and torch.equal(dst["w"], _state(2)["w"])
    assert torch.equal(dst["b"], _state(2)["b"])
    assert r.nbytes_read > 0 and r.nbytes_from_memory == r.nbytes_read
    assert r.nbytes_from_storage == 0

    dst = {"w": torch.zeros(N), "b": torch.zeros(8)}
    with ckptd.Checkpointer(url, rank=0, world_size=1, storage_options=options,
                            read_only=True) as c:  # and S3 itself holds it, bit-exact
        r = c.load(dst)
    assert r.step == 2 and r.nbytes_from_storage == r.nbytes_read > 0
    assert torch.equal(dst["w"], _state(2)["w"])


def _without_credentials(url: str, options: dict, conn) -> None:
    torch.set_num_threads(1)
    try:
        ckptd.Checkpointer(url, rank=0, world_size=1, storage_options=options,
                           agent=True).open()
        conn.send("no error")
    except Exception as e:  # noqa: BLE001 - what it was is the test's to check
        conn.send(f"{type(e).__name__}: {e}")


def test_an_agent_started_without_credentials_does_not_fail_the_next_job_s_saves(
        s3_bucket, agents, monkeypatch, tmp_path):
    """A first job without S3 credentials fails (as it must) and leaves a node agent; the next
    job exports its credentials: its saves commit — through an agent of its own environment,
    never the first job's (before: every save failed in the old agent with
    NoCredentialsError until ``ckptd agent --stop``)."""
    url = s3_bucket.url
    options = {"client_kwargs": {"endpoint_url": s3_bucket.server.endpoint_url,
                                 "region_name": "us-east-1"}}  # credentials from the environment
    # no credentials anywhere (and no instance-metadata lookup off this machine)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    saved = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                        "AWS_SESSION_TOKEN")}
    for k in saved:
        monkeypatch.delenv(k)
    # the first job, a process of its own (this one's S3 clients must not remember it)
    procs = fork_ranks(_without_credentials, lambda rank: (url, options), 1)
    try:
        assert procs[0][1].poll(120)
        said = procs[0][1].recv()
    finally:
        reap(procs)
    assert "credentials" in said.lower(), said
    first = agents.pid()  # it left an agent
    for k, v in saved.items():
        monkeypatch.setenv(k, v)
    with ckptd.Checkpointer(url, rank=0, world_size=1, storage_options=options,
                            agent=True) as c:
        assert c.executor == "agent"
        assert wire.lock_pid(agents.paths["lock"]) != first  # an agent of this environment
        c.save(_state(1), step=1)
    assert _latest(url, {**options, "key": "testing", "secret": "testing"}) == 1
    assert "testing" not in agents.log()  # no secret in any agent's log
