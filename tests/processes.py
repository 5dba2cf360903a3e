"""Helpers the tests share about where they run: the devices TensorFlow sees, fresh
interpreters (and a SavedModel served in one), and op error texts without TensorFlow's
device-dependent decorations."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import tensorflow as tf

import tf_ttemb

REPO_ROOT = pathlib.Path(tf_ttemb.__file__).resolve().parent.parent


def built_with_cuda() -> bool:
    """Whether the op library was built with its CUDA kernels (configure.sh's record)."""
    info = pathlib.Path(tf_ttemb.__file__).with_name("_build_info.json")
    return info.exists() and bool(json.loads(info.read_text()).get("cuda"))


def gpu_visible() -> bool:
    return bool(tf.config.list_physical_devices("GPU"))


def visible_devices() -> list:
    """ "/CPU:0", and "/GPU:0" when TensorFlow sees a GPU: for tests about one device."""
    return ["/CPU:0"] + (["/GPU:0"] if gpu_visible() else [])


def our_message(message: str) -> str:
    """An op's error text without TensorFlow's decorations, which differ by device and
    by how the op ran.

    TensorFlow may prefix it with "Graph execution error:", with "Detected at node ...
    defined at (most recent call last):" and a stack, or with "{{function_node
    __wrapped__<op>_device_/job:.../device:GPU:0}} "; follow it with
    "\\n\\t [[{{node <op>}}]]" and " [Op:<op>] ..."; and an assertion of the composite
    (`tf.debugging.Assert`) wraps it in "assertion failed: [...]". A graph in which
    several ops failed reports "N root error(s) found." and lists them as "(0) CODE:
    ..."; the first is taken.
    """
    message = re.sub(r"^Graph execution error:\s*", "", message)
    if message.startswith("Detected at node"):
        # The stack's lines are indented; the message is the first line that is not.
        lines = message.split("\n")[1:]
        body = [i for i, line in enumerate(lines) if line and not line.startswith(" ")]
        message = "\n".join(lines[body[0] :]) if body else message
    # Searched, not matched: whatever precedes the report (a stack) is dropped with it.
    root = re.search(r"\d+ root error\(s\) found\.\s*", message)
    if root:
        errors = re.split(r"\s*\(\d+\) [A-Z_]+:\s*", message[root.end() :])
        message = next(e for e in errors if e.strip())
        message = re.split(r"\n\s*\d+ successful operations\.", message)[0].rstrip()
    message = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", message)
    message = message.split(" [Op:")[0]
    while True:  # "[[{{node ...}}]]" and "[[<tensor name>]]" lines, one per frame
        trimmed = re.sub(r"\s*\[\[[^\n]*\]\]$", "", message)
        if trimmed == message:
            break
        message = trimmed
    wrapped = re.fullmatch(r"assertion failed: \[(.*)\]", message, flags=re.S)
    return wrapped.group(1) if wrapped else message


def run_fresh_python(
    script: str,
    *args: str,
    timeout: float = 300,
    all_lines: bool = False,
    without_tf_ttemb: bool = False,
):
    """Runs `script` in a fresh interpreter that can import tf_ttemb (unless
    `without_tf_ttemb`); returns its last line.

    With `all_lines`, returns every line it printed instead, whatever its exit status; a
    failed run adds a last line, JSON {"returncode": ..., "stderr": its tail}. TensorFloat-32
    matmuls stay off there too, as in this process (conftest.py).

    With `without_tf_ttemb`, the interpreter cannot import tf_ttemb instead: it runs
    isolated (`python -I`: no PYTHONPATH, no user site, not the current directory on
    sys.path) in an empty temporary directory, with this interpreter's installed packages
    (TensorFlow) only.
    """
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["NVIDIA_TF32_OVERRIDE"] = "0"
    command = [sys.executable, "-c", textwrap.dedent(script), *args]
    if without_tf_ttemb:
        env.pop("PYTHONPATH", None)
        command.insert(1, "-I")
    else:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
    with tempfile.TemporaryDirectory(prefix="fresh_python_") as empty:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            cwd=empty if without_tf_ttemb else None,
        )
    if all_lines:
        lines = result.stdout.splitlines()
        if result.returncode != 0:
            lines.append(
                json.dumps({"returncode": result.returncode, "stderr": result.stderr[-4000:]})
            )
        return lines
    assert result.returncode == 0, f"subprocess failed:\n{result.stderr[-4000:]}"
    return result.stdout.strip().splitlines()[-1]


def digests_at_thread_counts(script: str, counts=(1, 2, 3)) -> dict:
    """{threads: the digest `script` computes} with TensorFlow's intra-op pool at each
    size, one fresh CPU-only interpreter per count. `script` (at the top level of the
    snippet) feeds the bytes of the results it checks to `digest`, a hashlib.sha256 it is
    given; the caller asserts that every count gives the same digest (the kernels' work
    split over threads must not change a bit)."""
    header = (
        "import hashlib, sys\n"
        "import tensorflow as tf\n"
        "tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))\n"
        'tf.config.set_visible_devices([], "GPU")\n'
        "digest = hashlib.sha256()\n"
    )
    footer = "\nprint(digest.hexdigest())\n"
    full = header + textwrap.dedent(script) + footer
    digests = {t: run_fresh_python(full, str(t)) for t in counts}
    nothing = hashlib.sha256().hexdigest()
    assert nothing not in digests.values(), "the script fed no bytes to `digest`"
    return digests


def run_cli(*args: str, cwd=None, pythonpath: str = "") -> subprocess.CompletedProcess:
    """`python -m tf_ttemb ARGS` in a fresh interpreter, in the checkout (or `cwd`), that
    imports this checkout's tf_ttemb (after what `pythonpath` holds); its output captured,
    whatever its exit status, within 10 minutes."""
    path = os.pathsep.join(p for p in (pythonpath, str(REPO_ROOT)) if p)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-m", "tf_ttemb", *args],
        cwd=cwd or REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


SERVE_EXPORT = """
    import json, sys
    import numpy as np
    import tensorflow as tf
    import tf_ttemb  # registers the ops the SavedModel uses

    path, ids_file = sys.argv[1:]
    loaded = tf.saved_model.load(path)
    print(json.dumps(loaded.serve(tf.constant(np.load(ids_file))).numpy().tolist()))
"""


def served_in_fresh_process(path, ids: np.ndarray, folder) -> np.ndarray:
    """The `serve` signature of the SavedModel at `path`, called on `ids` in a fresh
    interpreter that imports tf_ttemb (`ids` travel in a file in `folder`), as float32."""
    ids_file = pathlib.Path(folder) / "ids.npy"
    np.save(ids_file, ids)
    got = run_fresh_python(SERVE_EXPORT, str(path), str(ids_file))
    return np.array(json.loads(got), np.float32)
