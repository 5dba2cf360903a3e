"""The benchmark programs' path helper: puts this checkout's tf_ttemb on sys.path and hands
out the package's one timing and memory utility, tf_ttemb/_timing.py.

The utility is loaded from its file, not as `tf_ttemb._timing`: importing the package would
import TensorFlow, and the benchmark drivers stay light (each measurement runs in a worker
process that imports the framework it measures). Every name of tf_ttemb/_timing.py is an
attribute of this module (`_bench_util.time_calls`, `_bench_util.PeakRss`, ...).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

CHECKOUT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_timing():
    name = "tf_ttemb_timing"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(CHECKOUT_ROOT, "tf_ttemb", "_timing.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while building
        spec.loader.exec_module(module)
    return sys.modules[name]


_timing = _load_timing()


def add_checkout_to_path() -> None:
    """Makes `import tf_ttemb` find the package of this checkout (not an installed one)."""
    if CHECKOUT_ROOT not in sys.path:
        sys.path.insert(0, CHECKOUT_ROOT)


def __getattr__(name: str) -> Any:
    return getattr(_timing, name)
