"""What the demo's sections share: timing, device probe, tables, plots and number formats."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_ttemb import _timing

MIB = _timing.MIB

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
    sync = tf.test.experimental.sync_devices if gpu_visible() else None
    return _timing.time_calls(fn, warmup, repeats, sync=sync).median_ms


format_table = _timing.format_table


def save_results(
    args: argparse.Namespace, name: str, document: Any, plot: Callable[[str], bool]
) -> None:
    """Writes a section's results to `--out`/NAME.json and, without `--no-plot`, its plot
    to NAME.png by `plot(path)` (False where matplotlib is not installed); says which."""
    json_path = os.path.join(args.out, f"{name}.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
    png_path = os.path.join(args.out, f"{name}.png")
    if args.no_plot:
        print(f"Saved {json_path}.")
    elif plot(png_path):
        print(f"Saved {png_path} and {json_path}.")
    else:
        print(f"Saved {json_path} (no plot: matplotlib is not installed).")


def save_two_panel_plot(path: str, title: str, draw: Callable[[Any], None]) -> bool:
    """Saves a PNG of two panels side by side, drawn by `draw(axes)` (the pair of matplotlib
    axes), under `title`; False, writing nothing, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    draw(axes)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


NOT_MEASURED = "not measured"


def ratio(numerator: Optional[float], denominator: Optional[float]) -> str:
    if numerator is None or denominator is None:
        return NOT_MEASURED
    if denominator <= 0:
        return "n/a (zero)"
    return f"{numerator / denominator:.1f}x"


def mib(num_bytes: Optional[float]) -> str:
    return _timing.mib_text(num_bytes, NOT_MEASURED)
