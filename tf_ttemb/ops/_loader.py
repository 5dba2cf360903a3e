"""Loads the op library `tf_ttemb/_tf_ttemb_ops.so`, in one place, after an ABI check.

`load_op_library()` opens the shared object once and caches the module of op wrappers.
`import tf_ttemb` calls `try_load_op_library()`, which loads it when it can, so that a
process that only imports tf_ttemb and then `tf.saved_model.load`s a model using the
custom ops finds them registered.

Two kinds of failure are told apart:

* The library was built for another TensorFlow: `_build_info.json` (written beside the
  library by `configure.sh`, shipped in the wheel) records the TensorFlow version, its
  C++11 ABI flag and the compile flags of the build. When the running TensorFlow's
  version, `tf.sysconfig.CXX11_ABI_FLAG` or `tf.sysconfig.get_compile_flags()` disagree,
  or the library was compiled for CPU extensions (`-mavx2`, `-mfma`, `-mf16c`) this CPU
  lacks, `import tf_ttemb` raises `BuildMismatchError` (an `ImportError`) naming both
  sides and the command that rebuilds the library. The library is never opened then:
  loading a shared object built against other TensorFlow headers can crash the process
  (or corrupt memory later) instead of failing cleanly. The check reads one small JSON
  file and TensorFlow's in-memory sysconfig; it adds well under a millisecond to the
  import.
* The library is missing, or TensorFlow refuses it: the import goes on (the composite
  implementation needs no library) and the first use of a custom op raises
  `OpLibraryNotFoundError` with the same advice.
"""

from __future__ import annotations

import json
import os
import threading
from types import ModuleType
from typing import Any

import tensorflow as tf

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY_PATH = os.path.join(_PACKAGE_DIR, "_tf_ttemb_ops.so")
BUILD_INFO_PATH = os.path.join(_PACKAGE_DIR, "_build_info.json")
# In a checkout the package sits beside configure.sh; in an installed wheel it does not.
_CHECKOUT_ROOT = os.path.dirname(_PACKAGE_DIR)
_CONFIGURE = os.path.join(_CHECKOUT_ROOT, "configure.sh")

# Compile flags that select CPU instruction set extensions -> the /proc/cpuinfo flag each
# needs at run time.
_CPU_EXTENSIONS = {"-mavx2": "avx2", "-mfma": "fma", "-mf16c": "f16c"}

_lock = threading.Lock()
_library: ModuleType | None = None


class OpLibraryNotFoundError(ImportError):
    """The op library is missing or does not load into the running TensorFlow."""


class BuildMismatchError(OpLibraryNotFoundError):
    """The op library was built for another TensorFlow (version or ABI) or another CPU."""


def read_build_info() -> dict[str, Any] | None:
    """The contents of `_build_info.json` beside the library, or None when unreadable.

    Returns:
      A dict with `tf_version` (str), `cxx11_abi` (int), `cuda` (bool) and
      `compile_flags` (list of str) as `configure.sh` writes them, or None when the file
      is missing or is not a JSON object.
    """
    try:
        with open(BUILD_INFO_PATH, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def running_tf_flags() -> list[str]:
    """The running TensorFlow's compile flags without include paths (what a build uses)."""
    return [f for f in tf.sysconfig.get_compile_flags() if not f.startswith("-I")]


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def rebuild_advice(built_version: str | None) -> str:
    """How to get a library that matches the running TensorFlow, as exact commands."""
    pin = f"run `pip install tensorflow=={built_version}` (the version it was built for)"
    if os.path.exists(_CONFIGURE):
        root = _CHECKOUT_ROOT
        rebuild = (
            f"rebuild it with `bash {os.path.join(root, 'configure.sh')}` (it builds against "
            f"the TensorFlow in {os.path.join(root, '.venv')})"
        )
    else:
        rebuild = (
            "rebuild the wheel against your TensorFlow in a tf_ttemb checkout: "
            "`bash configure.sh && bash build_wheel.sh`, then "
            "`pip install --force-reinstall dist/tf_ttemb-*.whl`"
        )
    if built_version:
        return f"Either {pin}, or {rebuild}."
    return rebuild[0].upper() + rebuild[1:] + "."


def build_mismatches(info: dict[str, Any] | None = None) -> list[str]:
    """What differs between the library's build and the running TensorFlow and CPU.

    Args:
      info: Build info to compare (default: `read_build_info()`).

    Returns:
      One line per difference (empty when they agree or when there is no build info to
      compare with).
    """
    info = read_build_info() if info is None else info
    if not info:
        return []
    problems = []
    built_version = info.get("tf_version")
    if built_version is not None and str(built_version) != tf.__version__:
        problems.append(
            f"TensorFlow version: built against {built_version}, running {tf.__version__}"
        )
    built_abi = info.get("cxx11_abi")
    running_abi = int(tf.sysconfig.CXX11_ABI_FLAG)
    if built_abi is not None and int(built_abi) != running_abi:
        problems.append(
            f"C++11 ABI (_GLIBCXX_USE_CXX11_ABI): built with {built_abi}, running "
            f"TensorFlow uses {running_abi}"
        )
    built_flags = info.get("compile_flags")
    if isinstance(built_flags, list):
        missing = [f for f in running_tf_flags() if f not in built_flags]
        if missing:
            problems.append(
                "compile flags: the running TensorFlow needs "
                f"{' '.join(missing)}, which the build did not use (build flags: "
                f"{' '.join(map(str, built_flags))})"
            )
        needed = [ext for flag, ext in _CPU_EXTENSIONS.items() if flag in built_flags]
        have = cpu_flags() if needed else None
        if have is not None:
            lacking = [ext for ext in needed if ext not in have]
            if lacking:
                problems.append(
                    f"CPU: the library was compiled for {', '.join(needed)}; this CPU lacks "
                    f"{', '.join(lacking)}"
                )
    return problems


def check_build() -> None:
    """Raises `BuildMismatchError` when the library exists but was built for another setup.

    Does nothing when the library file is missing (nothing would be loaded) or when there
    is no build info to compare with.

    Raises:
      BuildMismatchError: (an `ImportError`) naming the TensorFlow version of the build
        and the running one, every difference found, and the exact rebuild command.
    """
    if not os.path.exists(LIBRARY_PATH):
        return
    info = read_build_info()
    problems = build_mismatches(info)
    if problems:
        built_version = info.get("tf_version") if info else None
        raise BuildMismatchError(
            f"tf_ttemb's op library {LIBRARY_PATH} was built against TensorFlow "
            f"{built_version}, but the running TensorFlow is {tf.__version__} "
            f"({tf.__file__}); loading it could crash the process. Differences:\n  - "
            + "\n  - ".join(problems)
            + "\n"
            + rebuild_advice(str(built_version) if built_version else None)
        )


def _error(reason: str, built_for: str | None) -> OpLibraryNotFoundError:
    built = (
        f"TensorFlow {built_for}"
        if built_for
        else "an unknown TensorFlow version (no tf_version in tf_ttemb/_build_info.json)"
    )
    return OpLibraryNotFoundError(
        f"Could not load the tf_ttemb op library {LIBRARY_PATH}: {reason}. It was built "
        f"against {built}; the running TensorFlow is {tf.__version__}. "
        + rebuild_advice(built_for)
        + " Or pass implementation='composite', which needs no op library."
    )


def load_op_library() -> ModuleType:
    """Returns the module of generated op wrappers, loading the shared object once.

    Returns:
      The module `tf.load_op_library` returns for `tf_ttemb/_tf_ttemb_ops.so`; its
      functions are the ops (`tf_ttemb_gather_reduce_sum`, ...).

    Raises:
      BuildMismatchError: When `_build_info.json` says the library was built for another
        TensorFlow version, C++ ABI, compile flags or CPU (see `check_build`).
      OpLibraryNotFoundError: (an `ImportError`) when the file is missing or TensorFlow
        refuses it. The message names the TensorFlow version the library was built
        against and the running one, and says how to rebuild; TensorFlow's own error is
        chained as `__cause__`.
    """
    global _library
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            info = read_build_info()
            built_for = str(info["tf_version"]) if info and info.get("tf_version") else None
            if not os.path.exists(LIBRARY_PATH):
                raise _error("the file does not exist", built_for)
            check_build()
            try:
                _library = tf.load_op_library(LIBRARY_PATH)
            except (tf.errors.OpError, OSError) as e:
                raise _error(str(e).strip() or type(e).__name__, built_for) from e
    return _library


def try_load_op_library() -> bool:
    """Loads the op library if it is there; returns whether it is loaded.

    Raises:
      BuildMismatchError: When the library exists but was built for another TensorFlow
        or CPU (see `check_build`): `import tf_ttemb` fails with the rebuild command
        rather than run with a library that must not be loaded. A missing library, or one
        TensorFlow refuses, only returns False.
    """
    try:
        load_op_library()
    except BuildMismatchError:
        raise
    except OpLibraryNotFoundError:
        return False
    return True
