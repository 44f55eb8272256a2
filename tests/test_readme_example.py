"""The README's example resumes exactly: killed right after a committed save and run again, it
ends with the model and optimizer state of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import torch

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

# Runs the README's example code as written. With KILL_AFTER set, the process SIGKILLs itself
# once the save of that step has committed (the test synchronises on the commit, not on time).
# At the end it writes the final model and optimizer state for comparison.
WRAPPER = textwrap.dedent(
    """
    import os, signal, sys
    import torch, ckptd

    torch.set_num_threads(1)
    kill_after = int(os.environ.get("KILL_AFTER", "-1"))
    real_save_async = ckptd.save_async

    def save_async(state, **kw):
        handle = real_save_async(state, **kw)
        if state["step"] == kill_after:
            handle.result()                      # committed: now die without any cleanup
            os.kill(os.getpid(), signal.SIGKILL)
        return handle

    ckptd.save_async = save_async
    ns = {"__name__": "__readme__"}
    exec(compile(open(sys.argv[1]).read(), "README example", "exec"), ns)
    torch.save({"model": ns["model"].state_dict(), "optim": ns["opt"].state_dict()}, "final.pt")
    """
)


def _example() -> str:
    blocks = re.findall(r"## Example\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    return blocks[0]


def _run(cwd: pathlib.Path, kill_after: int | None = None) -> subprocess.CompletedProcess[str]:
    (cwd / "example.py").write_text(_example())
    env = None
    if kill_after is not None:
        import os

        env = dict(os.environ, KILL_AFTER=str(kill_after))
    return subprocess.run([sys.executable, "-c", WRAPPER, "example.py"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_readme_example_killed_after_a_save_resumes_exactly(tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    straight.mkdir()
    interrupted.mkdir()
    done = _run(straight)
    assert done.returncode == 0, done.stderr
    killed = _run(interrupted, kill_after=100)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (interrupted / "final.pt").exists()
    resumed = _run(interrupted)
    assert resumed.returncode == 0, resumed.stderr
    a = torch.load(straight / "final.pt")
    b = torch.load(interrupted / "final.pt")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for i, st in a["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optim"]["state"][i][k]), (i, k)
