"""The import-time ABI check of the op library (`tf_ttemb/ops/_loader.py`).

A mismatch is simulated on a temporary copy of the package whose `_build_info.json` is
edited (the real library is linked in), imported in fresh interpreters from a directory
outside the checkout, so the checkout's own package and build info are never touched.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import tensorflow as tf

import tf_ttemb
from tf_ttemb.ops import _loader

PACKAGE = pathlib.Path(tf_ttemb.__file__).parent
BUILD_INFO = json.loads((PACKAGE / "_build_info.json").read_text())

# What each case changes in the build info: (tf_version, cxx11_abi, compile_flags edit).
_MAJOR, _MINOR = (int(part) for part in tf.__version__.split(".")[:2])
OTHER_VERSION = f"{_MAJOR}.{_MINOR - 1}.3"


def _flags_with(old: str, new: str) -> list:
    flags = list(BUILD_INFO["compile_flags"])
    assert old in flags, (old, flags)
    return [new if f == old else f for f in flags]


CASES = {
    "same": {},
    "version": {"tf_version": OTHER_VERSION},
    "abi": {
        "cxx11_abi": 1 - int(BUILD_INFO["cxx11_abi"]),
        "compile_flags": _flags_with(
            f"-D_GLIBCXX_USE_CXX11_ABI={BUILD_INFO['cxx11_abi']}",
            f"-D_GLIBCXX_USE_CXX11_ABI={1 - int(BUILD_INFO['cxx11_abi'])}",
        ),
    },
    "eigen_align": {
        "compile_flags": _flags_with("-DEIGEN_MAX_ALIGN_BYTES=64", "-DEIGEN_MAX_ALIGN_BYTES=16")
    },
    "version_in_checkout": {"tf_version": OTHER_VERSION},
}

_PROBE = textwrap.dedent(
    """
    import json, sys
    result = {}
    try:
        import tf_ttemb
    except ImportError as e:
        result["error_type"] = type(e).__name__
        result["message"] = str(e)
    else:
        import numpy as np
        import tensorflow as tf
        result["file"] = tf_ttemb.__file__
        table = np.arange(12.0).reshape(4, 3)
        out = tf_ttemb.gather_reduce_sum(tf.constant(table), tf.constant([[3, 1, 3]]),
                                         implementation="custom_op")
        result["output"] = out.numpy().tolist()
    from tensorflow.python.framework import op_def_registry
    result["op_registered"] = op_def_registry.get("TfTtemb>GatherReduceSum") is not None
    print(json.dumps(result))
    """
)


def _copy_package(root: pathlib.Path, info: dict) -> None:
    shutil.copytree(
        PACKAGE,
        root / "tf_ttemb",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_info.json"),
    )
    (root / "tf_ttemb" / "_tf_ttemb_ops.so").symlink_to(PACKAGE / "_tf_ttemb_ops.so")
    (root / "tf_ttemb" / "_build_info.json").write_text(json.dumps(info))


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """Case -> (result of the probe, package root): all cases run at once."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    procs = {}
    for case, changes in CASES.items():
        root = tmp_path_factory.mktemp(case)
        _copy_package(root, dict(BUILD_INFO, **changes))
        if case.endswith("_in_checkout"):
            (root / "configure.sh").write_text("#!/bin/sh\n")
        procs[case] = (
            subprocess.Popen(
                [sys.executable, "-c", _PROBE],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            root,
        )
    results = {}
    for case, (proc, root) in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{case}: exit {proc.returncode}\n{err[-3000:]}"
        results[case] = (json.loads(out.strip().splitlines()[-1]), root)
    return results


def test_matching_build_imports_and_runs(imports):
    result, root = imports["same"]
    assert "message" not in result, result.get("message")
    assert pathlib.Path(result["file"]).resolve() == (root / "tf_ttemb" / "__init__.py").resolve()
    assert result["op_registered"]
    # ids [3, 1, 3] of arange(12).reshape(4, 3): rows 9..11 twice and 3..5 once.
    assert result["output"] == [[21.0, 24.0, 27.0]]


@pytest.mark.parametrize("case", ["version", "abi", "eigen_align", "version_in_checkout"])
def test_mismatch_raises_import_error(imports, case):
    result, root = imports[case]
    assert result.get("error_type") == "BuildMismatchError", result
    message = result["message"]
    built = CASES[case].get("tf_version", BUILD_INFO["tf_version"])
    library = root / "tf_ttemb" / "_tf_ttemb_ops.so"
    assert f"op library {library} was built against TensorFlow {built}" in message
    assert f"the running TensorFlow is {tf.__version__}" in message
    assert f"pip install tensorflow=={built}" in message
    if case.endswith("_in_checkout"):
        assert f"`bash {root / 'configure.sh'}`" in message
    else:
        assert "`bash configure.sh && bash build_wheel.sh`" in message
        assert "`pip install --force-reinstall dist/tf_ttemb-*.whl`" in message
    expected = {
        "version": f"TensorFlow version: built against {OTHER_VERSION}, running {tf.__version__}",
        "version_in_checkout": f"built against {OTHER_VERSION}, running {tf.__version__}",
        "abi": (
            f"C++11 ABI (_GLIBCXX_USE_CXX11_ABI): built with {1 - BUILD_INFO['cxx11_abi']}, "
            f"running TensorFlow uses {BUILD_INFO['cxx11_abi']}"
        ),
        "eigen_align": "the running TensorFlow needs -DEIGEN_MAX_ALIGN_BYTES=64, which the "
        "build did not use",
    }[case]
    assert expected in message
    # The library was never opened: its ops are not registered with TensorFlow.
    assert not result["op_registered"]


def test_cpu_extensions_checked(monkeypatch):
    flags = [f for f in BUILD_INFO["compile_flags"] if f not in ("-mavx2", "-mfma", "-mf16c")]
    info = dict(BUILD_INFO, compile_flags=flags + ["-mavx2", "-mfma"])
    monkeypatch.setattr(_loader, "cpu_flags", lambda: {"sse2", "fma", "avx"})
    problems = _loader.build_mismatches(info)
    assert problems == ["CPU: the library was compiled for avx2, fma; this CPU lacks avx2"]
    monkeypatch.setattr(_loader, "cpu_flags", lambda: {"sse2", "fma", "avx2", "f16c"})
    assert _loader.build_mismatches(info) == []


def test_this_build_matches_and_check_is_fast():
    assert _loader.build_mismatches() == []
    start = time.perf_counter()
    for _ in range(20):
        _loader.check_build()
    per_call = (time.perf_counter() - start) / 20
    # A few file reads and string compares: far below the seconds `import tensorflow` takes.
    assert per_call < 0.02, per_call
