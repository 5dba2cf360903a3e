"""`python -m tf_ttemb` commands (`info`, `--help`, `bench`'s options), run in subprocesses.

The op list `info` reports is checked against the REGISTER_OP lines of cc/ops/*.cc, and
its kernels against the build info. `bench`'s runs, presets and torch are tested in
tests/test_bench.py.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import tensorflow as tf
from processes import run_cli

import tf_ttemb

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
BUILD_INFO = json.loads((pathlib.Path(tf_ttemb.__file__).parent / "_build_info.json").read_text())


def _registered_op_names() -> list:
    names = []
    for path in sorted((CHECKOUT / "cc" / "ops").glob("*_ops.cc")):
        names += re.findall(r'REGISTER_OP\("TfTtemb>(\w+)"\)', path.read_text())
    return sorted(names)


# ----------------------------------------------------------------------------------------
# --help


def test_top_level_help_lists_commands():
    proc = run_cli("--help")
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
                "--in-graph-steps",
                "--preset",
                "--index-dtype",
                "--torch",
                "--tt-bags",
                "--tt-bag-size",
                "--tt-p",
                "--tt-q",
                "gather_reduce_sum",
                "tt_rows",
                "tt_bag",
                "pkm",
                "dlrm",
                "fbtt",
            ],
        ),
        ("info", ["--json", "registered kernels", "CUDA"]),
        ("demo", ["--quick", "--out"]),
    ],
)
def test_command_help(command, options):
    proc = run_cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m tf_ttemb {command}")
    for option in options:
        assert option in proc.stdout, option


def test_bench_rejects_bad_options():
    proc = run_cli("bench", "--dtypes", "float32,float8")
    assert proc.returncode == 2
    message = "unknown choice(s) 'float8'; choose from float16, bfloat16, float32, float64"
    assert message in proc.stderr
    proc = run_cli("bench", "--rows", "0")
    assert proc.returncode == 2
    assert "expected an integer >= 1, got 0" in proc.stderr
    proc = run_cli("bench", "--device", "TPU:7")
    assert proc.returncode == 2
    assert "--device TPU:7 is not one of TensorFlow's devices here: /device:CPU:0" in proc.stderr


# ----------------------------------------------------------------------------------------
# info


@pytest.fixture(scope="module")
def info_json():
    proc = run_cli("info", "--json", "-")
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
    proc = run_cli("info", "--json", str(path))
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
