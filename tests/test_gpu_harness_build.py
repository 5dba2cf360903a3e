"""The GPU harness library builds with nvcc alone and exports what python/gpu_harness/ calls.

The harness (`python/gpu_harness/build_gpu_harness.sh`: every kernel family in cuda/, and the
harness-only kernels and C ABI files in python/gpu_harness/, no TensorFlow) is what
python/gpu_harness/gpu_check.py drives on the GPU machine. The op library that configure.sh
builds compiles cuda/ but not python/gpu_harness/, so without this test a broken C ABI file,
or a function harness.py or harness_cache.py declares and the library lost, would
first show up in a device call. Loading the library needs no GPU (the CUDA runtime is
linked statically); nothing here launches a kernel.
"""

from __future__ import annotations

import ctypes
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")


def _declared_functions():
    """The C functions python/gpu_harness/harness*.py bind (the keys of their `sigs` tables)."""
    source = "".join(
        (ROOT / "python" / "gpu_harness" / name).read_text()
        for name in ("harness.py", "harness_cache.py")
    )
    return sorted(set(re.findall(r'^\s+"(tt\w+)"\s*:\s*\(', source, re.MULTILINE)))


def test_gpu_harness_declares_functions():
    # The parse above is what the build test relies on: it must find the three C ABI
    # families (gather_reduce_sum, TT, TT updates and cache).
    names = _declared_functions()
    for prefix in ("ttemb_forward", "ttemb_tt_rows_grad_compute", "ttupd_cache_count"):
        assert any(n.startswith(prefix) for n in names), (prefix, names)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_gpu_harness_builds_and_exports(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "python" / "gpu_harness" / "build_gpu_harness.sh"), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    lib = ctypes.CDLL(str(tmp_path / "libtf_ttemb_gpu_harness.so"))
    missing = [name for name in _declared_functions() if not hasattr(lib, name)]
    assert not missing, f"declared in python/gpu_harness/harness*.py, not exported: {missing}"
