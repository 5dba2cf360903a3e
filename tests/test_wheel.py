"""The platform wheel: its contents and metadata, and a working install in a fresh venv.

The wheel is built by `python/tools/build_wheel.py` (what Bazel's `//:wheel` runs) from the
op library `bash configure.sh` already built, so no Bazel build happens here.

The fresh venv, and why it is built this way (the fastest honest way found):

* The environment must hold TensorFlow and its dependencies and nothing else: no
  matplotlib, no pytest, no tf_ttemb source tree. Installing `tensorflow==<built version>`
  from PyPI into a new venv on every run costs a ~600 MB download (nothing caches it on a
  fresh CI machine) and a minute or two of unpacking on 2 cores.
* Instead, a site directory is assembled from the TensorFlow that `.venv` already holds
  (itself installed from PyPI by configure.sh): the distribution `tensorflow` and the
  closure of its `Requires-Dist` (markers evaluated for this interpreter, no extras),
  read from the installed metadata; every file of exactly those distributions (their
  RECORDs, compiled bytecode included) is symlinked into it. That takes about a second,
  needs no network, and holds the same files a PyPI install of those versions holds.
* The fresh venv (`python -m venv --without-pip`) sees that directory through a `.pth`
  file, the way `--system-site-packages` would show a base installation, and gets the
  wheel through pip (`pip --python <fresh venv>`, `--no-index`): pip resolves the
  wheel's Requires-Dist against what is installed and fails if the environment lacks
  any, instead of downloading it.

The checks then run from a temporary directory outside the checkout with a clean
PYTHONPATH, and assert that `tf_ttemb` comes from the venv's site-packages.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import tf_ttemb

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = pathlib.Path(tf_ttemb.__file__).resolve().parent
BUILD_INFO = json.loads((PACKAGE / "_build_info.json").read_text())

# Distributions that must not be in the base environment (they are in .venv).
NOT_TF_DEPENDENCIES = ("matplotlib", "pytest", "tf_ttemb")


def _clean_env() -> dict:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def _run_clean(command: list, cwd=None, check: bool = False) -> subprocess.CompletedProcess:
    """`command` run with its output captured as text, in `_clean_env()`."""
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, check=check, env=_clean_env()
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out_dir = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "python" / "tools" / "build_wheel.py"),
            "--out-dir",
            str(out_dir),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    path = pathlib.Path(proc.stdout.strip())
    assert path.parent == out_dir
    return path


def _tf_closure() -> dict:
    """Canonical name -> installed distribution, for tensorflow and all it requires.

    Distributions are looked up on this interpreter's path, the first one of a name
    winning as it does for imports (TensorFlow is in .venv's site-packages here; a staged
    TensorFlow, as on the GPU machine, may live in a directory of its own).
    """
    installed = {}
    for d in metadata.distributions():
        installed.setdefault(canonicalize_name(d.metadata["Name"]), d)
    closure, todo, missing = {}, ["tensorflow"], []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in closure or name in missing:
            continue
        if name not in installed:
            missing.append(name)
            continue
        closure[name] = installed[name]
        for text in installed[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    if missing:
        # A pip-installed TensorFlow (configure.sh's .venv, CI) has its whole closure; a
        # TensorFlow staged without some of it cannot make the fresh venv.
        pytest.skip(f"TensorFlow's requirements {sorted(missing)} are not installed")
    return closure


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> pathlib.Path:
    """A fresh venv that sees only TensorFlow's closure, with the wheel installed."""
    root = tmp_path_factory.mktemp("wheel_venv")
    base = root / "tf-base-site"
    closure = _tf_closure()
    for name in NOT_TF_DEPENDENCIES:
        assert canonicalize_name(name) not in closure, name
    linked = 0
    for dist in closure.values():
        for rel in dist.files or []:
            if rel.parts[0] == os.pardir:  # scripts outside site-packages
                continue
            source = pathlib.Path(dist.locate_file(rel))
            if not source.is_file():
                continue
            target = base / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(source)
                linked += 1
    assert linked > 1000, linked

    env_dir = root / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    fresh_site = _run_clean(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
    ).stdout.strip()
    (pathlib.Path(fresh_site) / "_tf_base.pth").write_text(f"{base}\n")
    proc = _run_clean(
        # --isolated: no pip config or PIP_* variables (no find-links), so with --no-index
        # nothing but the wheel can be installed.
        [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "--python",
            str(python),
            "install",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            str(wheel),
        ],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Looking in links" not in proc.stdout, proc.stdout
    assert "Successfully installed tf-ttemb-" in proc.stdout, proc.stdout
    return env_dir


def test_wheel_name_tags_and_metadata(wheel):
    version = tf_ttemb.__version__
    assert wheel.name == f"tf_ttemb-{version}-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel) as zf:
        dist_info = f"tf_ttemb-{version}.dist-info"
        wheel_file = zf.read(f"{dist_info}/WHEEL").decode()
        meta = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert "Root-Is-Purelib: false" in wheel_file.splitlines()
    assert "Tag: py3-none-linux_x86_64" in wheel_file.splitlines()
    headers = [line for line in meta.split("\n\n")[0].splitlines()]
    requires = sorted(
        line.split(": ", 1)[1] for line in headers if line.startswith("Requires-Dist")
    )
    assert requires == sorted(
        [
            f"tensorflow=={BUILD_INFO['tf_version']}",
            "numpy",
            "keras>=3",
            'matplotlib; extra == "demo"',
        ]
    )
    assert "Requires-Python: >=3.10" in headers
    assert "Provides-Extra: demo" in headers
    assert f"Version: {version}" in headers
    assert "tf-ttemb = tf_ttemb.__main__:main" in entry_points


def test_wheel_contents_and_record(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record_name = f"tf_ttemb-{tf_ttemb.__version__}.dist-info/RECORD"
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        # Every entry's hash and size in RECORD match its bytes; RECORD lists every entry.
        assert {row[0] for row in rows} == names
        for path, digest, size in rows:
            if path == record_name:
                assert digest == size == ""
                continue
            data = zf.read(path)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={want}", path
            assert int(size) == len(data), path
        library = zf.read("tf_ttemb/_tf_ttemb_ops.so")
        info = json.loads(zf.read("tf_ttemb/_build_info.json"))
        so_mode = (zf.getinfo("tf_ttemb/_tf_ttemb_ops.so").external_attr >> 16) & 0o777
    assert library == (PACKAGE / "_tf_ttemb_ops.so").read_bytes()
    assert so_mode == 0o755
    assert info == BUILD_INFO
    sources = {
        "tf_ttemb/" + p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts
    }
    packaged = {n for n in names if n.endswith(".py")}
    assert packaged == sources
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_builder_refuses_build_info_of_another_build(tmp_path):
    info = dict(BUILD_INFO, cuda=not BUILD_INFO["cuda"])
    path = tmp_path / "_build_info.json"
    path.write_text(json.dumps(info))
    proc = subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "python" / "tools" / "build_wheel.py"),
            "--build-info",
            str(path),
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert f"says cuda={str(info['cuda']).lower()}" in proc.stderr
    assert "come from different builds" in proc.stderr
    assert not list(tmp_path.glob("*.whl"))


_PROBE = textwrap.dedent(
    """
    import importlib.util, json, os, sys
    from importlib import metadata
    import numpy as np
    import tensorflow as tf
    import tf_ttemb
    from tf_ttemb import tt
    from tf_ttemb.layers import EmbeddingBag, ProductKeyMemory, TTEmbeddingBag

    rng = np.random.default_rng(int(sys.argv[1]))
    result = {
        "file": tf_ttemb.__file__,
        "version": metadata.version("tf_ttemb"),
        "sys_path": sys.path,
        "has_matplotlib": importlib.util.find_spec("matplotlib") is not None,
    }

    # The fused op (custom kernel), weighted mean over ragged bags, and its gradients.
    n, d = 37, 5
    table = rng.normal(size=(n, d))
    lengths = [3, 0, 6, 1]
    ids = rng.integers(0, n, size=sum(lengths))
    w = rng.uniform(0.5, 2.0, size=ids.size)
    up = rng.normal(size=(len(lengths), d))
    params = tf.Variable(table, dtype=tf.float64)
    with tf.GradientTape() as tape:
        out = tf_ttemb.gather_reduce_sum(
            params, tf.RaggedTensor.from_row_lengths(ids, lengths),
            tf.RaggedTensor.from_row_lengths(w, lengths), combiner="mean",
            implementation="custom_op")
    grad = tf.convert_to_tensor(tape.gradient(out, params, output_gradients=up)).numpy()
    want, want_grad, start = np.zeros((len(lengths), d)), np.zeros((n, d)), 0
    for b, length in enumerate(lengths):
        sl = slice(start, start + length)
        start += length
        if length:
            want[b] = (w[sl, None] * table[ids[sl]]).sum(0) / w[sl].sum()
            np.add.at(want_grad, ids[sl], w[sl, None] * up[b] / w[sl].sum())
    result["op_error"] = float(np.abs(out.numpy() - want).max())
    result["op_grad_error"] = float(np.abs(grad - want_grad).max())

    # The Keras layer on dense ids.
    layer = EmbeddingBag(n, d, combiner="sum", dtype="float64")
    dense_ids = rng.integers(0, n, size=(6, 4))
    got = layer(tf.constant(dense_ids)).numpy()
    weights = layer.get_weights()[0]
    result["layer_error"] = float(np.abs(got - weights[dense_ids].sum(1)).max())

    # The TT layer (custom op) against the float64 numpy reference of its cores.
    tt_layer = TTEmbeddingBag(1000, 8, tt_ranks=[3, 3], combiner="sum", seed=2,
                              dtype="float64", implementation="custom_op")
    tt_ids = rng.integers(0, 1000, size=(5, 3))
    tt_out = tt_layer(tf.constant(tt_ids)).numpy()
    cores = [c.numpy() for c in tt_layer.cores]
    ref = tt.rows(cores, tt_layer.tt_p_shapes, tt_layer.tt_q_shapes, [3, 3], tt_ids).sum(1)
    result["tt_error"] = float(np.abs(tt_out - ref).max())

    # Product-Key Memory: a forward pass.
    pkm = ProductKeyMemory(output_dim=6, n_keys=16, k_dim=8, heads=2, knn=4)
    pkm_out = pkm(tf.constant(rng.normal(size=(3, 7, 10)), tf.float32)).numpy()
    result["pkm_shape"] = list(pkm_out.shape)
    result["pkm_finite"] = bool(np.isfinite(pkm_out).all())
    print(json.dumps(result))
    """
)


def test_installed_wheel_works_outside_checkout(venv, tmp_path, rng):
    python = venv / "bin" / "python"
    seed = int(rng.integers(1 << 30))
    proc = _run_clean(
        [str(python), "-c", _PROBE, str(seed)],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert pathlib.Path(result["file"]).is_relative_to(venv), result["file"]
    assert not any(str(CHECKOUT) in p for p in result["sys_path"] if p), result["sys_path"]
    assert result["version"] == tf_ttemb.__version__
    assert not result["has_matplotlib"]  # only TensorFlow's closure is there
    assert result["op_error"] < 1e-10
    assert result["op_grad_error"] < 1e-10
    assert result["layer_error"] < 1e-10
    assert result["tt_error"] < 1e-10
    assert result["pkm_shape"] == [3, 7, 6]
    assert result["pkm_finite"]


def test_installed_cli(venv, tmp_path):
    script = venv / "bin" / "tf-ttemb"
    proc = _run_clean(
        [str(script), "--help"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "bench", "info"):
        assert command in proc.stdout
    proc = _run_clean(
        [str(venv / "bin" / "python"), "-m", "tf_ttemb", "info", "--json", "-"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout)
    assert pathlib.Path(info["package_dir"]).is_relative_to(venv)
    assert info["build"]["tf_version"] == BUILD_INFO["tf_version"]
    assert info["tf_version"] == BUILD_INFO["tf_version"]
    assert "CPU" in info["kernels"]["GatherReduceSum"]
