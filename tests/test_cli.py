"""The `ckptd` command as a user meets it: help for every argument, a start-up without torch,
errors in one line (never a traceback), `ls` that tells "nothing" from "not a root", a quiet
pipe into `head`, the README's command lines as written."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import torch

import ckptd
from ckptd.cli import build_parser, main
from ckptd.cli.elastic import remove_all_but
from ckptd.manifest import layout as L

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _saved(root: pathlib.Path, steps=(1, 2, 3)) -> str:
    with ckptd.Checkpointer(str(root), run_id="cli") as c:
        for s in steps:
            c.save({"model": {"w": torch.arange(12.0).reshape(3, 4) * s}, "step": s})
    return str(root)


def test_every_argument_of_every_command_has_help():
    parser = build_parser()
    assert "do not belong to a world size" in parser.format_help()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, sp in sub.choices.items():
        assert sp.description, name
        for action in sp._actions:
            if not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ckptd {ckptd.__version__}"


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["ls", "{root}"],
    ["plan", "--to-world", "8..64:8", "--hidden-size", "1024", "--num-layers", "8",
     "--num-params", "1e8", "--zero-stage", "1", "--world", "8", "--micro-batch", "2",
     "--accum", "4", "--seq-len", "512"],
    ["history", "{root}"],
])
def test_help_ls_plan_and_history_start_without_importing_torch(tmp_path, argv):
    root = _saved(tmp_path / "r")
    argv = [a.format(root=root) for a in argv]
    code = ("import sys\nfrom ckptd.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_ls_refuses_what_is_not_a_checkpoint_root(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "unrelated").mkdir()
    (tmp_path / "unrelated" / "notes.txt").write_text("x")
    for path, reason in [(tmp_path / "missing", "no such checkpoint root"),
                         (a_file, "not a directory"),
                         (tmp_path / "unrelated", "not a ckptd checkpoint root")]:
        assert main(["ls", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and reason in err.lower() and str(path) in err


def test_ls_lists_a_damaged_step_as_damaged_and_the_others_as_they_are(tmp_path, capsys):
    root = _saved(tmp_path / "r")
    with open(os.path.join(root, L.manifest_path(2)), "r+b") as f:
        f.truncate(40)
    assert main(["ls", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["state"], r["latest"]) for r in rows] == [
        (1, "committed", False), (2, "damaged", False), (3, "committed", True)]
    assert rows[1]["problem"].startswith(f"{root}/{L.manifest_path(2)}: ")
    assert main(["ls", root]) == 0
    out, err = capsys.readouterr()
    assert "damaged" in out and "committed (latest)" in out
    assert err.startswith(f"damaged: {root}/{L.manifest_path(2)}")


def test_an_empty_new_root_lists_no_steps(tmp_path, capsys):
    ckptd.Checkpointer(str(tmp_path / "new"), run_id="x").open().close()  # owner.json only
    assert main(["ls", str(tmp_path / "new")]) == 0
    assert "no steps yet" in capsys.readouterr().out


def test_inspect_into_head_exits_quietly(tmp_path):
    root = _saved(tmp_path / "r")
    with ckptd.Checkpointer(root, run_id="cli") as c:  # enough lines to fill the pipe
        c.save({f"t{i}": torch.ones(2) for i in range(3000)}, step=9)
    p = subprocess.run(f"{shlex.quote(sys.executable)} -m ckptd.cli inspect {root} | head -1",
                       shell=True, capture_output=True, text=True)
    assert p.stdout.startswith("checkpoint ")
    assert p.stderr == ""


def test_inspect_shows_bytes_values_by_their_size(tmp_path, capsys):
    root = str(tmp_path / "r")
    with ckptd.Checkpointer(root, run_id="cli") as c:  # a dataloader's pickled position
        c.save({"w": torch.ones(2), "loader": {"state": b"\x80\x04K\x07.", "n": 7}}, step=1)
    assert main(["inspect", root]) == 0
    assert 'values: {"loader/n": 7, "loader/state": "<5 bytes>"}' in capsys.readouterr().out


def test_inspect_json_reads_the_manifest_once_and_refuses_a_damaged_one(tmp_path, capsys,
                                                                         monkeypatch):
    from ckptd.storage.local import LocalStorage

    root = _saved(tmp_path / "r", steps=(1,))
    reads: list[str] = []
    real = LocalStorage.read_bytes

    def read_bytes(self, path):  # type: ignore[no-untyped-def]
        reads.append(path)
        return real(self, path)

    monkeypatch.setattr(LocalStorage, "read_bytes", read_bytes)
    assert main(["inspect", "--json", root]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1
    assert reads.count("step-000000001/manifest.json") == 1
    manifest = tmp_path / "r" / "step-000000001" / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    raw[-3] ^= 1  # in the tail: the digest no longer matches
    manifest.write_bytes(bytes(raw))
    assert main(["inspect", "--json", root]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "manifest" in captured.err and captured.err.count("\n") == 1


def test_an_error_is_one_line_and_a_bug_is_one_line_with_a_hint(tmp_path, capsys, monkeypatch):
    assert main(["inspect", str(tmp_path / "nothing-here")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err

    from ckptd.cli import steps

    def broken(args):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(steps, "cmd_ls", broken)
    assert main(["ls", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err == ("ckptd ls: internal error: RuntimeError: a bug over two lines "
                   "(set CKPTD_DEBUG=1 for the traceback)\n")


def test_reshard_reports_only_the_figures_it_computed(tmp_path, capsys):
    root = _saved(tmp_path / "r", steps=(1,))
    assert main(["reshard", root, "--to-world", "2", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "restart on the original" not in out and "committed " in out
    assert main(["reshard", root, "--to-world", "2", "--dry-run"]) == 0
    assert "a restart on the original would read" in capsys.readouterr().out


def test_the_readme_lists_every_command():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Command line", 1)[1].split("```")[1]
    listed = {line.split()[1] for line in block.splitlines() if line.startswith("ckptd ")}
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) - {"plan"} <= listed  # plan: its own example line below the block


def test_the_readme_plan_line_runs_as_written(capsys):
    text = (ROOT / "README.md").read_text()
    (line,) = re.findall(r"^ckptd plan .*$", text, re.M)
    argv = shlex.split(line)[1:]
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| world |") and len(table) == 2 + 100


def test_plan_from_a_checkpoint_without_elastic_metadata_infers_the_model(tmp_path, capsys):
    root = tmp_path / "plain"
    with ckptd.Checkpointer(str(root), rank=0, world_size=1) as c:
        c.save({"model": {f"layers.{i}.w": torch.ones(64, 64) for i in range(4)}}, step=1)
    argv = ["plan", "--from", str(root), "--to-world", "2,4", "--zero-stage", "1",
            "--micro-batch", "2", "--accum", "4", "--seq-len", "128"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "model inferred from its tensors (hidden 64, 4 layers" in err
    assert "previous world size 1 from its manifest" in err
    assert out.splitlines()[2].startswith("| 2 |")


def test_the_demo_says_where_its_files_are_and_that_it_removes_them(tmp_path, capsys):
    assert main(["demo", "--script", str(tmp_path / "missing.py"), "--phase-steps", "1"]) == 2
    out = capsys.readouterr().out.splitlines()
    workdir = out[0].split()[2]
    assert out[0] == (f"working directory {workdir} (temporary: all but history.png removed at "
                      "the end; --keep or --workdir DIR keeps it)")
    assert out[-1] == f"removed {workdir} (pass --keep or --workdir DIR to keep it)"
    assert not os.path.exists(workdir)
    kept = tmp_path / "kept"
    assert main(["demo", "--workdir", str(kept), "--script", str(tmp_path / "missing.py")]) == 2
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"checkpoints, events and logs are in {kept}")
    assert kept.is_dir()


def test_the_demo_keeps_only_its_plot_of_a_temporary_directory(tmp_path):
    work = tmp_path / "work"
    (work / "ckpt" / "step-000000010").mkdir(parents=True)
    (work / "events.jsonl").write_text("{}")
    (work / "history.png").write_bytes(b"png")
    assert remove_all_but(work, work / "history.png") == work / "history.png"
    assert sorted(p.name for p in work.iterdir()) == ["history.png"]
    elsewhere = tmp_path / "elsewhere.png"  # --plot FILE outside it: all of it goes
    assert remove_all_but(work, elsewhere) is None and not work.exists()


def _steps_100_and_200(root: pathlib.Path) -> str:
    with ckptd.Checkpointer(str(root), run_id="cli") as c:
        for s in (100, 200):
            c.save({"w": torch.full((2,), float(s))}, step=s)
    return str(root)


@pytest.mark.parametrize("argv", [["{root}/step-100"], ["{root}", "--step", "100"],
                                  ["{root}/step-000000100"], ["{root}/step-100/", "--step", "100"]])
def test_a_step_is_named_short_padded_or_with_step(tmp_path, capsys, argv):
    root = _steps_100_and_200(tmp_path / "r")
    argv = [a.format(root=root) for a in argv]
    assert main(["inspect", *argv]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"checkpoint {root}/step-000000100"
    assert main(["verify", *argv]) == 0
    assert "step 100:" in capsys.readouterr().out
    assert main(["history", *argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 100


def test_a_step_that_is_not_there_says_which_are(tmp_path, capsys):
    root = _steps_100_and_200(tmp_path / "r")
    assert main(["inspect", f"{root}/step-150"]) == 2
    assert capsys.readouterr().err == (
        f"ckptd inspect: error: {root}: step 150: no such step (committed: 200, 100)\n")
    assert main(["inspect", f"{root}/step-100", "--step", "200"]) == 2
    assert capsys.readouterr().err == (f"ckptd inspect: error: {root}/step-100 and --step 200 "
                                       "name different steps: give one of them\n")
    # a root that happens to be named like a step stays a root
    other = _steps_100_and_200(tmp_path / "step-5")
    assert main(["inspect", other]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"checkpoint {other}/step-000000200"


@pytest.mark.parametrize("command", ["ls", "inspect"])
def test_output_into_a_closed_pipe_exits_0_quietly(tmp_path, command):
    # `ckptd ls ROOT | head -1`, without the race: the reader is gone before the first write
    root = _saved(tmp_path / "r")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        p = subprocess.run([sys.executable, "-m", "ckptd.cli", command, root], stdout=write_end,
                           stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert (p.returncode, p.stderr) == (0, "")


def test_a_broken_pipe_that_is_not_stdout_is_an_error(tmp_path, capsys, monkeypatch):
    from ckptd.cli import steps

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a socket to a storage server

    monkeypatch.setattr(steps, "cmd_ls", broken)
    assert main(["ls", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "ckptd ls: error: [Errno 32] Broken pipe\n"


@pytest.mark.parametrize("argv, message", [
    (["reshard", "{root}", "--to-world", "0", "--dry-run"], "argument --to-world"),
    (["reshard", "{root}", "--to-world", "2", "--tp", "0", "--dry-run"], "argument --tp"),
    (["layout", "{root}", "--world", "0"], "argument --world"),
    (["layout", "{root}", "--pp", "-1"], "argument --pp"),
])
def test_a_world_size_or_degree_below_1_is_refused(tmp_path, capsys, argv, message):
    root = _saved(tmp_path / "r", steps=(1,))
    with pytest.raises(SystemExit) as e:
        main([a.format(root=root) for a in argv])
    value = argv[argv.index(message.split()[1]) + 1]
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: {message}: must be an integer >= 1, got '{value}'")


def test_history_plot_of_a_checkpoint_without_elastic_metadata_is_one_line(tmp_path, capsys):
    root = _saved(tmp_path / "r", steps=(1,))
    assert main(["history", root, "--plot", str(tmp_path / "h.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "h.png").exists()
    assert err == (f"ckptd history: error: {root} step 1 has no elastic metadata (it was not "
                   "saved by ckptd.elastic): no history to plot (without --plot, `ckptd "
                   "history` lists its steps)\n")
