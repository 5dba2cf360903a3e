"""`python -m tf_ttemb` commands (`info`, `bench`, `--help`), run in subprocesses.

The op list `info` reports is checked against the REGISTER_OP lines of cc/ops/*.cc, and
its kernels against the build info; `bench` runs at small odd sizes and its JSON is
checked for every case, implementation and dtype asked for, positive times and agreeing
implementations.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import tf_ttemb

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
BUILD_INFO = json.loads((pathlib.Path(tf_ttemb.__file__).parent / "_build_info.json").read_text())


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(CHECKOUT))
    return subprocess.run(
        [sys.executable, "-m", "tf_ttemb", *args],
        cwd=cwd or CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def _registered_op_names() -> list:
    names = []
    for path in sorted((CHECKOUT / "cc" / "ops").glob("*_ops.cc")):
        names += re.findall(r'REGISTER_OP\("TfTtemb>(\w+)"\)', path.read_text())
    return sorted(names)


# ----------------------------------------------------------------------------------------
# --help


def test_top_level_help_lists_commands():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "bench", "info"):
        assert re.search(rf"^\s+{command}\s+\S", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize(
    "command,options",
    [
        (
            "bench",
            [
                "--quick",
                "--json",
                "--threads",
                "--dtypes",
                "--cases",
                "--device",
                "--rows",
                "--dim",
                "--bags",
                "--bag-size",
                "--tt-rows",
                "--tt-rank",
                "--pkm-tokens",
                "--pkm-keys",
                "--repeats",
                "--warmup",
                "gather_reduce_sum",
                "tt_rows",
                "pkm",
            ],
        ),
        ("info", ["--json", "registered kernels", "CUDA"]),
        ("demo", ["--quick", "--out"]),
    ],
)
def test_command_help(command, options):
    proc = _run(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m tf_ttemb {command}")
    for option in options:
        assert option in proc.stdout, option


def test_bench_rejects_bad_options():
    proc = _run("bench", "--dtypes", "float32,float8")
    assert proc.returncode == 2
    message = "unknown choice(s) 'float8'; choose from float16, bfloat16, float32, float64"
    assert message in proc.stderr
    proc = _run("bench", "--rows", "0")
    assert proc.returncode == 2
    assert "expected an integer >= 1, got 0" in proc.stderr
    proc = _run("bench", "--device", "TPU:7")
    assert proc.returncode == 2
    assert "--device TPU:7 is not one of TensorFlow's devices here: /device:CPU:0" in proc.stderr


# ----------------------------------------------------------------------------------------
# info


@pytest.fixture(scope="module")
def info_json():
    proc = _run("info", "--json", "-")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_info_versions_and_build(info_json):
    assert info_json["tf_ttemb_version"] == tf_ttemb.__version__
    assert info_json["tf_version"] == tf.__version__
    assert info_json["build"] == BUILD_INFO
    assert info_json["build_mismatches"] == []
    assert info_json["library_loaded"] is True
    assert info_json["tf_cxx11_abi"] == int(tf.sysconfig.CXX11_ABI_FLAG)
    assert info_json["installed_from"] == "checkout"
    assert pathlib.Path(info_json["package_dir"]) == CHECKOUT / "tf_ttemb"
    assert info_json["library_bytes"] == (CHECKOUT / "tf_ttemb" / "_tf_ttemb_ops.so").stat().st_size
    devices = {d["name"] for d in info_json["physical_devices"]}
    assert devices == {d.name for d in tf.config.list_physical_devices()}


def test_info_lists_every_op_and_its_kernels(info_json):
    ops = _registered_op_names()
    assert len(ops) >= 10
    assert info_json["ops"] == sorted("TfTtemb>" + op for op in ops)
    assert sorted(info_json["kernels"]) == ops
    for op, per_device in info_json["kernels"].items():
        assert "CPU" in per_device, op
        assert all(entry["count"] >= 1 for entry in per_device.values()), op
    cpu = info_json["kernels"]["GatherReduceSum"]["CPU"]
    assert cpu["count"] == 8
    assert cpu["constraints"]["T"] == ["float16", "bfloat16", "float32", "float64"]
    assert cpu["constraints"]["Tindices"] == ["int32", "int64"]
    # CUDA kernels: compiled in exactly when the build says so.
    assert info_json["cuda_kernels_registered"] is BUILD_INFO["cuda"]
    assert ("GPU" in info_json["kernels"]["GatherReduceSum"]) is BUILD_INFO["cuda"]


def test_info_text_and_json_file(tmp_path):
    path = tmp_path / "info.json"
    proc = _run("info", "--json", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(rf"^TensorFlow \(running\)\s+{re.escape(tf.__version__)} ", out, re.M), out
    assert re.search(
        rf"^TensorFlow \(built against\)\s+{re.escape(BUILD_INFO['tf_version'])}$", out, re.M
    ), out
    assert re.search(r"^  match\s+yes$", out, re.M), out
    cuda = "yes" if BUILD_INFO["cuda"] else "no"
    assert re.search(rf"^  CUDA kernels \(build info\)\s+{cuda}$", out, re.M), out
    assert re.search(rf"^  CUDA kernels \(registered\)\s+{cuda}$", out, re.M), out
    assert " ".join(BUILD_INFO["compile_flags"]) in out
    for op in _registered_op_names():
        assert re.search(rf"^  {op}\s+CPU\s+\d+", out, re.M), op
    assert json.loads(path.read_text())["ops"] == sorted(
        "TfTtemb>" + op for op in _registered_op_names()
    )


# ----------------------------------------------------------------------------------------
# bench


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = _run(
        "bench",
        "--quick",
        "--dtypes",
        "float32,float64",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--rows",
        "3001",
        "--dim",
        "7",
        "--bags",
        "33",
        "--bag-size",
        "5",
        "--tt-rows",
        "5003",
        "--tt-dim",
        "12",
        "--tt-rank",
        "3",
        "--tt-lookups",
        "257",
        "--pkm-tokens",
        "37",
        "--pkm-dim",
        "24",
        "--pkm-keys",
        "16",
        "--pkm-knn",
        "4",
        "--threads",
        "2",
        "--json",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(path.read_text())


def test_bench_json(bench_run):
    _, result = bench_run
    rows = result["results"]
    got = sorted((r["case"], r["dtype"], r["impl"]) for r in rows)
    want = sorted(
        [
            (c, d, i)
            for c in ("gather_reduce_sum", "tt_rows")
            for d in ("float32", "float64")
            for i in ("custom_op", "tf_gather")
        ]
        + [("pkm", "float32", "custom_op"), ("pkm", "float32", "composite")]
        # torch's embedding_bag joins the gather_reduce_sum case on the CPU where installed.
        + [
            ("gather_reduce_sum", d, "torch")
            for d in ("float32", "float64")
            if importlib.util.find_spec("torch") is not None
        ]
    )
    assert got == want
    tolerance = {"float32": 1e-4, "float64": 1e-10}
    for r in rows:
        assert r["baseline"] is (r["impl"] in ("tf_gather", "composite")), r
        for kind in ("fwd", "fwd_bwd"):
            timing = r[kind]
            assert timing["repeats"] == 2
            assert math.isfinite(timing["median_ms"]) and timing["median_ms"] > 0, r
            assert 0 < timing["min_ms"] <= timing["median_ms"], r
            # The implementations agree with the baseline (which is 0 against itself).
            assert 0 <= r["max_rel_diff"][kind] < tolerance[r["dtype"]], r
            if r["baseline"]:
                assert r["max_rel_diff"][kind] == 0.0
        # The in-graph forward: --in-graph-steps (2 with --quick) forwards in one call,
        # per forward; none for torch.
        if r["impl"] == "torch":
            assert r["fwd_in_graph"] is None
        else:
            loop = r["fwd_in_graph"]
            assert math.isfinite(loop["median_ms"]) and 0 < loop["min_ms"] <= loop["median_ms"]
    shapes = {r["case"]: r["shape"] for r in rows}
    assert shapes["gather_reduce_sum"] == "3,001x7 table, 33 bags x 5 ids, weighted sum"
    assert shapes["tt_rows"].startswith("5,003x12 table as TT")
    assert shapes["tt_rows"].endswith("257 ids")
    assert shapes["pkm"] == "37 tokens x 24, 16**2 = 256 slots, 2 heads x 4 knn"
    env = result["environment"]
    assert env["tf_version"] == tf.__version__
    assert env["build"] == BUILD_INFO
    assert env["intra_op_threads"] == 2
    assert result["options"]["rows"] == 3001 and result["options"]["tt_rank"] == 3
    assert result["seconds"] > 0


def test_bench_table(bench_run):
    out, result = bench_run
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case "))
    table = lines[header : header + 2 + len(result["results"])]
    # Aligned: every line of the table has the header's width.
    assert len({len(line.rstrip()) for line in table}) == 1, table
    for r, line in zip(result["results"], table[2:]):
        cells = line.split()
        assert cells[:3] == [r["case"], r["dtype"], r["impl"]], line
        off = 1 if r["baseline"] else 0
        assert float(cells[3 + off]) == pytest.approx(r["fwd"]["median_ms"], abs=1e-3)
        loop = r["fwd_in_graph"]
        assert cells[5 + off] == ("n/a" if loop is None else f"{loop['median_ms']:.3f}"), line
