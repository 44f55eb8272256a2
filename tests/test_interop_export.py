"""Exports: a ckptd checkpoint as torch.distributed.checkpoint, and as Hugging Face safetensors.

The source is saved on 4 ranks under ``tp2_dp2_zero1``: tensor-parallel ``Fused`` QKV and
gate/up, vocab-padded ``Shard`` s and ZeRO ``FlatShard`` s in which a replicated norm sits at
different offsets in each TP rank's buffer (partially overlapping chunks), so an export must
consolidate every leaf kind and take each element once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import multirank
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)
import transformer_state as ts
from safetensors import safe_open
from transformer_state import LAYOUTS, Layout, build_state

import ckptd
from ckptd.cli import main
from ckptd.interop import FuseRule, export_safetensors
from ckptd.regions import Box
from ckptd.sharding import LOCAL_PREFIX, Local, describe

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SOURCE = "tp2_dp2_zero1"


def _save(rank: int, world: int, root: str) -> None:
    with ckptd.Checkpointer(root, rank=rank, world_size=world) as ck:
        ck.save(build_state(LAYOUTS[SOURCE], rank, ts.reference()).state, step=ts.STEP)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("export") / "root")
    multirank.run(_save, LAYOUTS[SOURCE].world_size, root, timeout=120)
    return root


# --- DCP ----------------------------------------------------------------------------------------


def _dcp_load(rank: int, world: int, path: str) -> list[str]:
    layout = Layout("dtensor_tp2", tp=2, dtensor=True)
    dst = build_state(layout, rank, None)
    state = {k: v for k, v in dst.state.items() if not isinstance(v, Local)}
    dcp.load(state, checkpoint_id=path)
    ref = ts.reference()
    out = []
    for p in describe(state, rank, world).pieces:
        want = ref[p.name][p.box.within(Box.whole(tuple(ref[p.name].shape)))]
        if not torch.equal(p.view.view(torch.int32), want.contiguous().view(torch.int32)):
            out.append(f"rank {rank}: {p.name} {p.box} differs")
    values = (state["step"], state["optim"]["step"], state["meta"])
    if values != (ts.STEP, ts.OPTIM_STEP, {"layout": SOURCE, "lr": 3e-4}):
        out.append(f"rank {rank}: values {values}")
    return out


def test_dcp_export_loads_with_dcp_into_dtensors_on_two_ranks(ckpt, tmp_path, capsys):
    out = str(tmp_path / "dcp")
    assert main(["export", ckpt, "--format", "dcp", "--out", out]) == 0
    printed = capsys.readouterr().out
    # 4 ranks' Local RNG tensors, and the data position's two leaves, which differ by rank
    assert f"of step {ts.STEP} to {out}" in printed and "left out 6 per-rank values" in printed
    assert sorted(p.name for p in Path(out).iterdir()) == [".metadata", "__0_0.distcp"]
    problems = multirank.run(_dcp_load, 2, out, timeout=120)
    assert [line for lines in problems for line in lines] == []


def test_dcp_export_refuses_safetensors_options(ckpt, tmp_path, capsys):
    assert main(["export", ckpt, "--format", "dcp", "--out", str(tmp_path), "--dtype", "bf16"]) == 2
    assert "--dtype: safetensors only" in capsys.readouterr().err


# --- safetensors --------------------------------------------------------------------------------


def read_safetensors(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                assert index["weight_map"][name] == file
                tensors[name] = f.get_tensor(name)
    return tensors, index


def model_reference(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        n.removeprefix("model/"): t.to(dtype)
        for n, t in ts.reference().items()
        if n.startswith("model/")
    }


def test_safetensors_export_consolidates_refuses_and_shards_like_transformers(
    ckpt, tmp_path, capsys
):
    out = tmp_path / "hf"
    fuse = [
        "layers.*.attn.qkv.weight=layers.*.attn.q.weight,layers.*.attn.k.weight,"
        "layers.*.attn.v.weight",
        "layers.*.mlp.gate_up.weight=layers.*.mlp.gate.weight,layers.*.mlp.up.weight@0",
    ]
    args = [
        "export",
        ckpt,
        "--format",
        "safetensors",
        "--out",
        str(out),
        "--select",
        "model/*",
        "--strip-prefix",
        "model/",
        "--max-shard-size",
        "2KB",
        "--no-config",
    ]
    assert main(args + [a for f in fuse for a in ("--fuse", f)]) == 0
    assert "tensors" in capsys.readouterr().out
    got, index = read_safetensors(out)
    want = model_reference()
    for i in range(ts.LAYERS):
        pre = f"layers.{i}"
        want[f"{pre}.attn.qkv.weight"] = torch.cat(
            [want.pop(f"{pre}.attn.{x}.weight") for x in "qkv"]
        )
        want[f"{pre}.mlp.gate_up.weight"] = torch.cat(
            [want.pop(f"{pre}.mlp.{x}.weight") for x in ("gate", "up")]
        )
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert sorted(p.name for p in out.iterdir()) == files + ["model.safetensors.index.json"]
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in want.values())
    for file in files:  # no file passes 2 KB unless it holds a single larger tensor
        names = [n for n, f in index["weight_map"].items() if f == file]
        size = sum(want[n].numel() * 4 for n in names)
        assert size <= 2000 or len(names) == 1, (file, size)


def test_safetensors_export_casts_floats_and_fuses_along_any_dim_in_small_slabs(ckpt, tmp_path):
    out = tmp_path / "bf16"
    rule = FuseRule("layers.*.mixed", ("layers.*.attn.o.weight", "layers.*.mlp.down.weight"), dim=1)
    report = export_safetensors(
        ckpt,
        str(out),
        select=["model/*"],
        strip_prefix="model/",
        dtype="bf16",
        fuse=[rule],
        slab_bytes=64,  # two rows of 8 floats at a time: slabs cross part boundaries
        no_config=True,
    )
    got, _ = read_safetensors(out)
    want = model_reference(torch.bfloat16)
    for i in range(ts.LAYERS):
        o, d = want.pop(f"layers.{i}.attn.o.weight"), want.pop(f"layers.{i}.mlp.down.weight")
        want[f"layers.{i}.mixed"] = torch.cat([o, d], dim=1)
    assert report.tensors == len(want) and sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t), name


def test_every_logical_tensor_exports_and_locals_stay_out(ckpt, tmp_path):
    report = export_safetensors(ckpt, str(tmp_path / "all"), max_shard_size=10**9,
                                select=["*"], no_config=True)
    got, _ = read_safetensors(tmp_path / "all")
    ref = {n.replace("/", "."): t for n, t in ts.reference().items()}
    assert report.files == ["model-00001-of-00001.safetensors"]
    assert sorted(got) == sorted(ref) and not any(LOCAL_PREFIX in n for n in got)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--select", "nothing/*"], "no logical tensor matches ['nothing/*']"),
        (
            ["--fuse", "qkv=layers.*.attn.q.weight,layers.*.attn.k.weight"],
            "fuse rule qkv: no output tensor is named layers.*.attn.q.weight",
        ),
        (
            [
                "--strip-prefix",
                "model/",
                "--fuse",
                "qkv=layers.*.attn.q.weight,layers.*.attn.k.weight",
            ],
            "fuse pattern 'qkv': want 1 '*'",
        ),
        (
            ["--strip-prefix", "model/", "--fuse", "l.*=layers.*.attn.q.weight,nope.*"],
            "fuse l.0: parts ['nope.0'] are not (unfused) outputs",
        ),
        (["--fuse", "broken"], "fuse rule 'broken': want TARGET=PART,PART[,...][@DIM]"),
        (["--dtype", "int3"], "dtype 'int3': want one of"),
        (["--max-shard-size", "5 parsecs"], "size '5 parsecs'"),
    ],
)
def test_bad_export_options_fail_in_one_line_before_writing(ckpt, tmp_path, capsys, extra, message):
    out = tmp_path / "never"
    every = [] if "--select" in extra else ["--select", "*"]
    assert main(["export", ckpt, "--format", "safetensors", "--out", str(out), "--no-config",
                 *every, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


# --- memory -------------------------------------------------------------------------------------

# One tensor of 128 MiB (and a small one): exporting tensor by tensor would hold it, and its read
# buffers, at once; exporting in slabs holds a few slabs whatever the tensor's size.
ROWS, COLS, TENSORS = 8192, 4096, 2
MiB = 1 << 20
# Peak RSS of each export alone: the kernel's high-water mark is reset (clear_refs 5) after the
# imports (DCP's modules included: code is not export memory) and read back (VmHWM) after the
# export. Page cache is not RSS; read buffers and staged slabs are.
_MEASURE = textwrap.dedent(
    """
    import json, re, sys
    import torch
    import torch.distributed.checkpoint
    from ckptd.interop import export_dcp, export_safetensors
    def status(key):
        text = open("/proc/self/status").read()
        return int(re.search(key + r":\\s+(\\d+) kB", text).group(1)) * 1024
    ckpt, out = sys.argv[1:]
    peaks = {}
    for fmt, export in (("safetensors", export_safetensors), ("dcp", export_dcp)):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS")
        more = {"no_config": True, "select": ["*"]} if fmt == "safetensors" else {}
        export(ckpt, f"{out}/{fmt}", **more)
        peaks[fmt] = status("VmHWM") - before
    print(json.dumps(peaks))
    """
)


def big(i: int) -> torch.Tensor:
    rows = ROWS if i == 0 else 3
    return torch.arange(rows * COLS, dtype=torch.float32).view(rows, COLS) * (i + 1)


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, int], Path]:
    """Export a 256 MiB checkpoint both ways in a fresh process; the peak RSS of each."""
    base = tmp_path_factory.mktemp("big")
    with ckptd.Checkpointer(str(base / "root"), keep_last=0) as ck:
        ck.save({"model": {f"w{i}": big(i) for i in range(TENSORS)}}, step=1)
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(base / "root"), str(base / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), base / "out"


LARGEST = ROWS * COLS * 4


def test_safetensors_export_streams_with_peak_memory_below_the_largest_tensor(peaks):
    peak, out = peaks[0]["safetensors"], peaks[1] / "safetensors"
    print(
        f"safetensors export, largest tensor {LARGEST // MiB} MiB: peak RSS +{peak / MiB:.1f} MiB"
    )
    assert peak < LARGEST, f"peak +{peak / MiB:.1f} MiB, largest tensor {LARGEST // MiB} MiB"
    got, _ = read_safetensors(out)
    assert sorted(got) == [f"model.w{i}" for i in range(TENSORS)]
    for i in range(TENSORS):
        assert torch.equal(got[f"model.w{i}"], big(i))


def test_dcp_export_streams_with_peak_memory_below_the_largest_tensor(peaks):
    peak, out = peaks[0]["dcp"], peaks[1] / "dcp"
    print(f"dcp export, largest tensor {LARGEST // MiB} MiB: peak RSS +{peak / MiB:.1f} MiB")
    assert peak < LARGEST, f"peak +{peak / MiB:.1f} MiB, largest tensor {LARGEST // MiB} MiB"
    state = {"model": {f"w{i}": torch.zeros_like(big(i)) for i in range(TENSORS)}}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    for i in range(TENSORS):
        assert torch.equal(state["model"][f"w{i}"], big(i))
