"""Large tables on transparent huge pages (cc/kernels/huge_pages.h).

The CPU kernels move a table of at least 16 MiB that they see twice at the same address
onto 2 MiB pages (MADV_HUGEPAGE + MADV_COLLAPSE). The lookups and updates must stay exact
across the move, and the move must happen where Linux allows it and not with
TF_TTEMB_HUGE_PAGES=0.
"""

from __future__ import annotations

import json
import pathlib
import platform

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import assert_close
from processes import run_fresh_python

import tf_ttemb
from tf_ttemb.ops.sparse_apply import gather_reduce_sum_sparse_apply

# 17 MiB of float32: above the kernels' 16 MiB threshold, small enough for CI.
ROWS, DIM = 4_352, 1_024


@pytest.fixture(autouse=True)
def _on_cpu():
    """The CPU kernels' tables (where a GPU is visible too)."""
    with tf.device("/CPU:0"):
        yield


def _thp_mode() -> str:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled, or ""."""
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if platform.system() != "Linux" or not path.exists():
        return ""
    text = path.read_text()
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else ""


def _kernel_collapses() -> bool:
    """MADV_COLLAPSE exists from Linux 6.1."""
    release = platform.release().split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (6, 1)
    except (IndexError, ValueError):
        return False


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_lookups_and_weights_grad_stay_exact_across_the_move(rng, dtype):
    table64 = rng.normal(size=(ROWS, DIM))
    table = tf.Variable(tf.cast(table64, dtype))
    table64 = tf.cast(table, tf.float64).numpy()  # the rounded values the op sees
    for _ in range(3):  # the move happens at the second call
        ids = rng.integers(0, ROWS, size=(17, 5))
        weights64 = rng.normal(size=ids.shape)
        upstream64 = rng.normal(size=(17, DIM))
        weights = tf.Variable(tf.cast(weights64, dtype))
        with tf.GradientTape() as tape:
            out = tf_ttemb.gather_reduce_sum(table, ids, weights)
        grad_w = tape.gradient(out, weights, output_gradients=tf.cast(upstream64, dtype))
        weights64 = tf.cast(weights, tf.float64).numpy().reshape(-1)
        splits = np.arange(0, ids.size + 1, ids.shape[1])
        want, scale = reference.forward(table64, ids.reshape(-1), splits, weights64)
        assert_close(out, want, scale, dtype, "forward")
        want_w = reference.weights_grad(
            table64,
            ids.reshape(-1),
            splits,
            weights64,
            tf.cast(tf.cast(upstream64, dtype), tf.float64).numpy(),
        )
        assert_close(tf.reshape(grad_w, [-1]), want_w[0], want_w[1], dtype, "weights grad")


@pytest.mark.parametrize("combiner", ["sum", "max"])
def test_a_large_fresh_output_stays_exact(rng, combiner):
    """A forward whose [B, D] output (and max's argmax) is over the kernels' 8 MiB
    threshold for fresh memory, advised huge pages before its first write: many short
    bags (some empty), as one-hot features at a large batch give."""
    rows, dim, bags = 37, 1_031, 2_200  # 8.7 MiB of float32 output
    # float64 copies of the float32 values the op sees
    table64 = rng.normal(size=(rows, dim)).astype(np.float32).astype(np.float64)
    lengths = rng.integers(0, 3, size=bags)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, rows, size=splits[-1])
    weights64 = None
    if combiner == "sum":
        weights64 = rng.normal(size=ids.shape).astype(np.float32).astype(np.float64)
    for _ in range(2):  # a second call writes memory the first one freed
        out = tf_ttemb.gather_reduce_sum(
            tf.constant(table64, tf.float32),
            tf.RaggedTensor.from_row_splits(ids, splits),
            None if weights64 is None else tf.RaggedTensor.from_row_splits(weights64, splits),
            combiner=combiner,
        )
        want, scale = reference.forward(table64, ids, splits, weights64, combiner)
        assert_close(out, want, scale, tf.float32, "forward")


def test_fused_sgd_updates_stay_exact_across_the_move(rng):
    table64 = rng.normal(size=(ROWS, DIM)).astype(np.float32).astype(np.float64)
    table = tf.Variable(table64.astype(np.float32))
    trigger = tf.Variable(tf.zeros([0], tf.float32))
    for _ in range(3):
        ids = rng.integers(0, ROWS, size=(9, 4))
        upstream = rng.normal(size=(9, DIM)).astype(np.float32)
        with tf.GradientTape() as tape:
            out = gather_reduce_sum_sparse_apply(
                table, ids, trigger=trigger, optimizer="sgd", learning_rate=0.5
            )
        tape.gradient(out, trigger, output_gradients=upstream)
        grad, _ = reference.params_grad(
            table64, ids.reshape(-1), np.arange(0, ids.size + 1, 4), upstream.astype(np.float64)
        )
        table64 = table64 - 0.5 * grad
        np.testing.assert_allclose(table.numpy(), table64, rtol=1e-5, atol=1e-5)


_MOVE_SCRIPT = """
import json, os, sys
if sys.argv[1] == "off":
    os.environ["TF_TTEMB_HUGE_PAGES"] = "0"
import numpy as np, tensorflow as tf, tf_ttemb

rows, dim = 8_192, 1_024  # 32 MiB
with tf.device("/CPU:0"):  # the CPU kernels' tables; a GPU's memory is not paged so
    table = tf.Variable(tf.random.stateless_normal([rows, dim], seed=[1, 2]))
start = np.from_dlpack(table.value()).ctypes.data
end = start + rows * dim * 4

def huge_kib():
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            try:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
            except ValueError:
                continue
            inside = lo < end and hi > start
        elif inside and fields[0] == "AnonHugePages:":
            total += int(fields[1])
    return total

ids = tf.constant([[1, 5000, 8191], [7, 7, 0]], tf.int64)
seen = []
for _ in range(3):
    with tf.device("/CPU:0"):
        out = tf_ttemb.gather_reduce_sum(table, ids)
    seen.append(huge_kib())
want = tf.gather(table, ids).numpy().sum(axis=1)
print(json.dumps({"huge_kib": seen, "same": bool(np.array_equal(out.numpy(), want))}))
"""


@pytest.mark.skipif(
    _thp_mode() not in ("madvise", "always") or not _kernel_collapses(),
    reason="needs Linux 6.1+ with transparent huge pages not 'never'",
)
@pytest.mark.parametrize("switch", ["on", "off"])
def test_a_table_seen_twice_moves_to_huge_pages(switch):
    result = json.loads(run_fresh_python(_MOVE_SCRIPT, switch))
    assert result["same"]
    first, second, third = result["huge_kib"]
    if _thp_mode() == "madvise":  # "always" may give huge pages from the start
        assert first == 0, result
    if switch == "off":
        assert second == third == (0 if _thp_mode() == "madvise" else first), result
    else:
        # 32 MiB hold at least 15 whole 2 MiB pages, whatever the alignment.
        assert second >= 15 * 2048 and third == second, result
