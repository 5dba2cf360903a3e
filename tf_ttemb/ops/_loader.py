"""Loads the op library `tf_ttemb/_tf_ttemb_ops.so`, in one place.

`load_op_library()` opens the shared object once and caches the module of op wrappers.
`import tf_ttemb` calls `try_load_op_library()`, which does the same but never raises:
a process that only imports tf_ttemb and then `tf.saved_model.load`s a model using the
custom ops finds them registered, while a missing or stale library does not break the
import (the composite implementation needs none); the error, with its explanation, is
raised on the first use of the custom op instead.

A library whose `_build_info.json` records another TensorFlow version than the running
one is not opened at all: loading a shared object built against other TensorFlow headers
can crash the process instead of failing cleanly.
"""

from __future__ import annotations

import json
import os
import threading
from types import ModuleType

import tensorflow as tf

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY_PATH = os.path.join(_PACKAGE_DIR, "_tf_ttemb_ops.so")
BUILD_INFO_PATH = os.path.join(_PACKAGE_DIR, "_build_info.json")

_lock = threading.Lock()
_library: ModuleType | None = None


class OpLibraryNotFoundError(ImportError):
    """The op library is missing or does not load into the running TensorFlow."""


def _recorded_tf_version() -> str | None:
    """The TensorFlow version recorded by the build in _build_info.json, if any."""
    try:
        with open(BUILD_INFO_PATH, encoding="utf-8") as f:
            version = json.load(f).get("tf_version")
    except (OSError, ValueError, AttributeError):
        return None
    return str(version) if version else None


def _error(reason: str, built_for: str | None) -> OpLibraryNotFoundError:
    built = (
        f"TensorFlow {built_for}"
        if built_for
        else "an unknown TensorFlow version (no tf_version in tf_ttemb/_build_info.json)"
    )
    return OpLibraryNotFoundError(
        f"Could not load the tf_ttemb op library {LIBRARY_PATH}: {reason}. It was built "
        f"against {built}; the running TensorFlow is {tf.__version__}. Rebuild it with "
        "`bash configure.sh` in the repository root (or pass implementation='composite', "
        "which needs no op library)."
    )


def load_op_library() -> ModuleType:
    """Returns the module of generated op wrappers, loading the shared object once.

    Returns:
      The module `tf.load_op_library` returns for `tf_ttemb/_tf_ttemb_ops.so`; its
      functions are the ops (`tf_ttemb_gather_reduce_sum`, ...).

    Raises:
      OpLibraryNotFoundError: (an `ImportError`) when the file is missing, was built
        against another TensorFlow version, or TensorFlow refuses it. The message names
        the TensorFlow version the library was built against and the running one, and
        says how to rebuild; TensorFlow's own error is chained as `__cause__`.
    """
    global _library
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            built_for = _recorded_tf_version()
            if not os.path.exists(LIBRARY_PATH):
                raise _error("the file does not exist", built_for)
            if built_for is not None and built_for != tf.__version__:
                raise _error("TensorFlow versions differ", built_for)
            try:
                _library = tf.load_op_library(LIBRARY_PATH)
            except (tf.errors.OpError, OSError) as e:
                raise _error(str(e).strip() or type(e).__name__, built_for) from e
    return _library


def try_load_op_library() -> bool:
    """Loads the op library if it can; returns whether it is loaded. Never raises."""
    try:
        load_op_library()
    except OpLibraryNotFoundError:
        return False
    return True
