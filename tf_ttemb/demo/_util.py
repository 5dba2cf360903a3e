"""What the demo's sections share: timing, device probe, tables and number formats."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

MIB = float(1 << 20)

# ----------------------------------------------------------------------------------------
# Measuring.


def gpu_visible() -> bool:
    """Whether TensorFlow sees a GPU (then the demo's steps run there)."""
    return bool(tf.config.list_physical_devices("GPU"))


def median_time_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median wall-clock milliseconds of `fn()` over `repeats` calls after `warmup` calls.

    Each call is timed until every device is done with it (on a GPU a call returns once
    its kernels are queued).
    """
    sync = tf.test.experimental.sync_devices if gpu_visible() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        )

    return "\n".join(
        [line(headers), "-+-".join("-" * width for width in widths)] + [line(r) for r in rows]
    )


NOT_MEASURED = "not measured"


def ratio(numerator: Optional[float], denominator: Optional[float]) -> str:
    if numerator is None or denominator is None:
        return NOT_MEASURED
    if denominator <= 0:
        return "n/a (zero)"
    return f"{numerator / denominator:.1f}x"


def mib(num_bytes: Optional[float]) -> str:
    return NOT_MEASURED if num_bytes is None else f"{num_bytes / MIB:,.1f}"
