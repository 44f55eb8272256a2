"""Shared fixtures: a moto S3 server on 127.0.0.1, and ``backend``, one Storage per backend kind
(``local``: LocalStorage; ``memory``: memory://; ``s3``: a fresh bucket on the moto server;
``fsspec-file``: FsspecStorage's generic path on a real directory).

The moto server runs in its own process (its request handling then does not compete with the
test for the GIL), bound to port 0 by the child itself, which prints the port once it listens:
no port race and no polling. It allows 64 KiB multipart parts (real S3: 5 MiB) so that tests can
exercise many-part uploads with small objects. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from agent_procs import Agents, serve_agents

# Which executor runs the saves of the tests that do not choose: the in-process path
# (CKPTD_TEST_EXECUTOR=process, the default), or the node agent (=agent: every writing
# Checkpointer hands its saves to one agent of the whole run, in a directory and under a node id
# of its own, stopped at the end). A test that tests the agent itself asks for it (``agent=True``
# inside the ``agents`` fixture's directory). No test may start an agent in the user's own
# agent directory, nor leave one running.
EXECUTOR = os.environ.get("CKPTD_TEST_EXECUTOR", "process")
if EXECUTOR not in ("process", "agent"):
    raise SystemExit(f"CKPTD_TEST_EXECUTOR={EXECUTOR!r}: 'process' or 'agent'")
os.environ["CKPTD_AGENT"] = "1" if EXECUTOR == "agent" else "0"
# The tests' states are small: below the default CKPTD_AGENT_MIN_BYTES (1 MiB) a save would be
# written in process even where an agent runs, and no test of the agent's path would reach it.
# Every save a test gives an agent goes to it; test_agent_min_bytes.py unsets this and tests
# the default's split.
os.environ["CKPTD_AGENT_MIN_BYTES"] = "0"
if EXECUTOR == "agent":
    os.environ["CKPTD_AGENT_DIR"] = tempfile.mkdtemp(prefix="ckag")
    os.environ["CKPTD_NODE_ID"] = f"suite{os.getpid()}"


# Test modules that run the same whichever executor the suite uses — they save through no
# Checkpointer that leaves the executor to the default (the node agent's own tests ask for it
# where they test it), or save nothing: the agent executor's pass leaves them out (deselected,
# counted in pytest's summary), since the process pass runs them.
SAME_UNDER_EITHER = {
    "test_agent.py", "test_agent_gate.py", "test_agent_kills.py", "test_agent_holdings.py",
    "test_agent_memory_use.py", "test_agent_restart.py", "test_agent_s3.py",
    "test_agent_commits.py", "test_agent_min_bytes.py",
    "test_agent_trust.py", "test_data_order.py", "test_data_shuffle.py", "test_regions.py",
    "test_replan.py", "test_public_api.py", "test_gcpause.py", "test_benchmarks.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if EXECUTOR != "agent":
        return
    same = [i for i in items if os.path.basename(str(i.fspath)) in SAME_UNDER_EITHER]
    if same:
        config.hook.pytest_deselected(items=same)
        items[:] = [i for i in items if i not in same]


@pytest.fixture(scope="session", autouse=True)
def _suite_agent() -> Iterator[None]:
    """With the agent executor: stop the run's agent at the end (none may be left)."""
    yield
    if EXECUTOR == "agent":
        from agent_procs import stop_agents_in

        stop_agents_in(os.environ["CKPTD_AGENT_DIR"], os.environ["CKPTD_NODE_ID"])

# Small enough that the suite's objects span many parts and ranged GETs; moto's minimum matches.
TEST_PART_BYTES = 64 << 10
_MOTO_MAIN = """
import sys
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server
server = make_server("127.0.0.1", 0, DomainDispatcherApplication(create_backend_app), threaded=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"""
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class MotoServer:
    port: int

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(_AWS_ENV)
    env["S3_UPLOAD_PART_MIN_SIZE"] = str(TEST_PART_BYTES)
    env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(16 << 20)  # keep test objects in memory
    log_path = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _MOTO_MAIN], stdout=subprocess.PIPE, stderr=log, text=True,
            env=env,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child prints its port once it listens
        if not line.strip().isdigit():
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"moto server did not start (exit code {proc.poll()}): {tail}")
        yield MotoServer(int(line))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_options(endpoint_url: str) -> dict[str, Any]:
    """ckptd ``storage_options`` for a moto endpoint (what a user passes for a private S3)."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
    }


@dataclass(frozen=True)
class S3Bucket:
    url: str  # s3://bucket/prefix, the checkpoint root
    storage_options: dict[str, Any]
    bucket: str
    prefix: str
    server: MotoServer

    def options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """``storage_options`` for this bucket, optionally through another endpoint (a proxy)."""
        return s3_options(endpoint_url or self.server.endpoint_url)

    def storage(self, endpoint_url: str | None = None, **transfer: Any) -> Any:
        """An S3Storage on the root, tuned for tests (see :func:`fast_transfer`)."""
        from ckptd.storage.s3_storage import S3Storage

        options = self.options(endpoint_url)
        return S3Storage(self.url, options, transfer=fast_transfer(**transfer))

    def client(self) -> Any:
        """A boto3 client straight to moto (no proxy), to check what the server holds."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.server.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )


@pytest.fixture
def s3_bucket(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh moto server state with one empty bucket; yields the root URL and options."""
    for name, value in _AWS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    moto_server.reset()
    bucket = S3Bucket(
        url="s3://ckptd-test/run",
        storage_options=s3_options(moto_server.endpoint_url),
        bucket="ckptd-test",
        prefix="run",
        server=moto_server,
    )
    bucket.client().create_bucket(Bucket=bucket.bucket)
    yield bucket


def fast_transfer(**changes: Any) -> Any:
    """S3 tuning for tests: tiny parts, and retries that back off in milliseconds."""
    from ckptd.storage.s3_transfer import S3Transfer

    base: dict[str, Any] = dict(
        part_bytes=TEST_PART_BYTES, concurrency=4, max_attempts=6, base_delay_s=0.002,
        max_delay_s=0.02,
    )
    base.update(changes)
    return S3Transfer(**base)


@pytest.fixture(params=["local", "memory", "s3", "fsspec-file"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    """One Storage per backend kind; the storage test suite runs against each."""
    kind = request.param
    if kind == "local":
        from ckptd.storage import open_storage

        yield open_storage(str(tmp_path / "root"))
    elif kind == "fsspec-file":  # the generic fsspec path on a real filesystem
        from ckptd.storage.fsspec_backend import FsspecStorage

        yield FsspecStorage(f"file://{tmp_path}/root")
    elif kind == "memory":
        from ckptd.storage.fsspec_backend import FsspecStorage

        storage = FsspecStorage(f"memory://ckptd-test-{uuid.uuid4().hex}")
        yield storage
        storage.remove("")
    else:
        bucket: S3Bucket = request.getfixturevalue("s3_bucket")
        yield bucket.storage()


@pytest.fixture
def clean_sigterm() -> Iterator[None]:
    """SIGTERM's handler and ckptd's preemption state as they were before the test."""
    from ckptd.elastic import preemption as preemption_module

    before = signal.getsignal(signal.SIGTERM)
    preemption_module.uninstall()
    try:
        yield
    finally:
        preemption_module.uninstall()
        signal.signal(signal.SIGTERM, before)


@pytest.fixture
def agents(monkeypatch: pytest.MonkeyPatch) -> Iterator[Agents]:
    """Node agents of this test: its own agent directory and node id (``agent_procs``)."""
    yield from serve_agents(monkeypatch)
