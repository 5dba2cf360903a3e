"""The CPU forward's two instruction sets give the same bits: the AVX-512 bag sums and maxes
(chosen at run time where the CPU has AVX512F/BW/VL) and the AVX2 ones
(TF_TTEMB_CPU_ISA=avx2, what every other x86-64 CPU runs), over the row widths whose code
paths differ (tails of one to fifteen lanes, one and several vectors, the widest unrolled
chunk of the sum and of the max and beyond), every dtype, mean weighted and not, and max
(with its argmax, through the gradient). Both agree with the float64 reference. The
results have the same bits with the rows prefetched into L1 or L2 (TF_TTEMB_ROW_PREFETCH),
whole or by their first line only (TF_TTEMB_ROW_PREFETCH_LINES), and at any thread count
(blocks go to whichever thread is free)."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import assert_close
from processes import digests_at_thread_counts, run_fresh_python

DIMS = [1, 3, 8, 15, 16, 17, 31, 32, 33, 64, 65, 100, 127, 128, 129, 255, 256, 257, 264, 272]
DIMS += [513, 1024, 1025]  # wider than one AVX-512 pass: the one-pass wide-row sum
DTYPES = ["float16", "bfloat16", "float32", "float64"]
TESTS_DIR = pathlib.Path(__file__).resolve().parent


def mean_inputs(dim, name, weighted):
    """(table, ids, weights) of the mean lookups (name: the dtype, which seeds them too),
    with padding (-1) entries and one bag of padding only."""
    rng = np.random.default_rng(dim * 7 + len(name) + weighted)
    table = rng.standard_normal((50, dim))
    ids = rng.integers(-1, 50, size=(9, 13))
    ids[6] = -1
    weights = rng.random((9, 13)) if weighted else None
    return table, ids, weights


def max_inputs(dim, name):
    """(table, ids, upstream) of the max lookup: small integers (ties everywhere) and one
    NaN, with padding and an empty bag."""
    rng = np.random.default_rng(dim * 11 + len(name))
    table = rng.integers(-3, 4, size=(50, dim)).astype(np.float64)
    table[7, dim // 2] = np.nan
    ids = rng.integers(-1, 50, size=(9, 13))
    ids[4] = -1
    upstream = rng.standard_normal((9, dim))
    return table, ids, upstream


SCRIPT = """
import json, sys
import numpy as np
import tensorflow as tf
import tf_ttemb

out_path, dims, dtypes = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path.insert(0, sys.argv[4])  # the tests' folder: the inputs are this module's
from test_cpu_isa import max_inputs, mean_inputs
results = {}
for dim in dims:
    for name in dtypes:
        for weighted in (False, True):
            table, ids, weights = mean_inputs(dim, name, weighted)
            with tf.device("/CPU:0"):
                got = tf_ttemb.gather_reduce_sum(
                    tf.cast(tf.constant(table), name),
                    tf.constant(ids),
                    None if weights is None else tf.cast(tf.constant(weights), name),
                    combiner="mean",
                    padding_id=-1,
                )
            key = f"{dim}-{name}-{weighted}"
            results[key] = tf.cast(got, tf.float64).numpy()
        # max over small integers (ties everywhere) and one NaN, with padding and an
        # empty bag; the dense gradient shows the argmax.
        table, ids, upstream = max_inputs(dim, name)
        with tf.device("/CPU:0"):
            params = tf.cast(tf.constant(table), name)
            with tf.GradientTape() as tape:
                tape.watch(params)
                got = tf_ttemb.gather_reduce_sum(
                    params, tf.constant(ids), combiner="max", padding_id=-1, dense_grad=True
                )
            grad = tape.gradient(got, params, output_gradients=tf.cast(upstream, name))
        results[f"{dim}-{name}-max"] = tf.cast(got, tf.float64).numpy()
        results[f"{dim}-{name}-max-grad"] = tf.cast(grad, tf.float64).numpy()
np.savez(out_path, **results)
print("done")
"""


# Row widths around 512 B, where the chunked loops' row prefetches move from L2 to L1 on
# Intel cores (RowPrefetchLevel in gather_reduce_sum_cpu.h): float32 rows of 508, 512 and
# 1,024 B, half rows of 256 and 512 B, float64 rows of 1,016 and 2,048 B.
PREFETCH_DIMS = [127, 128, 256]
# Rows that the forward's loops prefetch whole or by their first line only
# (RowPrefetchFirstLineOnly): float32 rows of 256 to 1,024 B, long enough that the
# look-ahead entry lies inside the 117 entries for part of the loop.
LINES_DIMS = [64, 127, 128, 256]
# name: (environment, dims). "default" is what this CPU picks on its own.
RUNS = {
    "default": ({}, DIMS),
    "avx2": ({"TF_TTEMB_CPU_ISA": "avx2"}, DIMS),
    "rows-l1": ({"TF_TTEMB_ROW_PREFETCH": "l1"}, PREFETCH_DIMS),
    "rows-l2": ({"TF_TTEMB_ROW_PREFETCH": "l2"}, PREFETCH_DIMS),
    "avx2-rows-l1": ({"TF_TTEMB_CPU_ISA": "avx2", "TF_TTEMB_ROW_PREFETCH": "l1"}, PREFETCH_DIMS),
    "rows-all-lines": ({"TF_TTEMB_ROW_PREFETCH_LINES": "all"}, LINES_DIMS),
    "rows-first-line": ({"TF_TTEMB_ROW_PREFETCH_LINES": "first"}, LINES_DIMS),
    "avx2-rows-first-line": (
        {"TF_TTEMB_CPU_ISA": "avx2", "TF_TTEMB_ROW_PREFETCH_LINES": "first"},
        LINES_DIMS,
    ),
}
CHOICES = ("TF_TTEMB_CPU_ISA", "TF_TTEMB_ROW_PREFETCH", "TF_TTEMB_ROW_PREFETCH_LINES")


@pytest.fixture(scope="module")
def both_paths(tmp_path_factory):
    """{run name: its results} of every RUNS entry, each in a fresh process (both choices
    are read once per process)."""
    folder = tmp_path_factory.mktemp("isa")
    outputs = {}
    for name, (environment, dims) in RUNS.items():
        path = folder / f"{name}.npz"
        with pytest.MonkeyPatch.context() as patch:
            for variable in CHOICES:
                if variable in environment:
                    patch.setenv(variable, environment[variable])
                else:
                    patch.delenv(variable, raising=False)
            last = run_fresh_python(
                SCRIPT, str(path), json.dumps(dims), json.dumps(DTYPES), str(TESTS_DIR)
            )
        assert last == "done", last
        outputs[name] = dict(np.load(pathlib.Path(path)))
    return outputs


@pytest.mark.parametrize("dim", DIMS)
def test_avx512_and_avx2_forward_agree_bitwise(both_paths, dim):
    for name in DTYPES:
        for weighted in (False, True):
            key = f"{dim}-{name}-{weighted}"
            np.testing.assert_array_equal(
                both_paths["default"][key], both_paths["avx2"][key], err_msg=key
            )
            table, ids, weights = mean_inputs(dim, name, weighted)
            cast = tf.cast(tf.cast(tf.constant(table), name), tf.float64).numpy()
            w = None
            if weights is not None:
                w = tf.cast(tf.cast(tf.constant(weights), name), tf.float64).numpy().reshape(-1)
            want, scale = reference.forward(
                cast, ids.reshape(-1), np.arange(10) * 13, w, "mean", -1
            )
            assert_close(both_paths["avx2"][key], want, scale, tf.as_dtype(name), key)


@pytest.mark.parametrize("dim", DIMS)
def test_avx512_and_avx2_max_agree_bitwise(both_paths, dim):
    for name in DTYPES:
        for key in (f"{dim}-{name}-max", f"{dim}-{name}-max-grad"):
            np.testing.assert_array_equal(
                both_paths["default"][key], both_paths["avx2"][key], err_msg=key
            )
        table, ids, upstream = max_inputs(dim, name)
        splits = np.arange(10) * 13
        want, _ = reference.forward(table, ids.reshape(-1), splits, None, "max", -1)
        np.testing.assert_array_equal(both_paths["avx2"][f"{dim}-{name}-max"], want)
        up = tf.cast(tf.cast(tf.constant(upstream), name), tf.float64).numpy()
        want_grad, scale = reference.params_grad(
            table, ids.reshape(-1), splits, up, None, "max", -1
        )
        got_grad = both_paths["avx2"][f"{dim}-{name}-max-grad"]
        assert_close(got_grad, want_grad, scale, tf.as_dtype(name), f"{dim}-{name}-max-grad")


@pytest.mark.parametrize(
    "run",
    [
        "rows-l1",
        "rows-l2",
        "avx2-rows-l1",
        "rows-all-lines",
        "rows-first-line",
        "avx2-rows-first-line",
    ],
)
def test_row_prefetch_choice_keeps_the_bits(both_paths, run):
    """Where the chunked loops prefetch rows to (L1 or L2) and how much of each row (every
    line or the first), on either instruction set, changes no result: every mean and max
    lookup, and the max gradient, has the default run's bits (which
    test_avx512_and_avx2_* check against float64)."""
    got = both_paths[run]
    assert len(got) == len(RUNS[run][1]) * len(DTYPES) * 4
    for key, value in got.items():
        np.testing.assert_array_equal(value, both_paths["default"][key], err_msg=f"{run} {key}")


def _disassembly(symbol_part: str) -> dict:
    """{function name: its x86-64 disassembly} of the op library's functions whose
    demangled name contains `symbol_part` (objdump from binutils, beside the compiler)."""
    import shutil
    import subprocess

    import tf_ttemb

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    library = pathlib.Path(tf_ttemb.__file__).with_name("_tf_ttemb_ops.so")
    text = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    functions, name = {}, None
    for line in text.splitlines():
        if line.endswith(">:"):
            name = line[line.index("<") + 1 : -2] if symbol_part in line else None
            if name is not None:
                functions[name] = []
        elif name is not None:
            functions[name].append(line)
    return {k: "\n".join(v) for k, v in functions.items()}


@pytest.mark.skipif(
    __import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86-64 code only"
)
@pytest.mark.parametrize("kernel", ["BagChunkSum<", "BagChunkMax<", "BagSum512<"])
def test_forward_bag_loops_prefetch_rows(kernel):
    """The forward's bag loops prefetch rows ahead, into L2, and rows of 512 B or more on
    Intel cores into L1: GCC 12 once deleted every __builtin_prefetch loop there
    (PrefetchLine in gather_reduce_sum_cpu.h). BagSum512 holds the wide-row loop
    (BagWideSum512, inlined)."""
    bodies = _disassembly(kernel)
    float_bodies = {k: v for k, v in bodies.items() if ", float, long" in k}
    assert float_bodies, f"no {kernel}...float, long...> function in the op library"
    for instruction in ("prefetcht1", "prefetcht0"):
        assert any(instruction in body for body in float_bodies.values()), (
            instruction,
            sorted(float_bodies),
        )


THREADS_SCRIPT = """
    import numpy as np
    import tf_ttemb
    rng = np.random.default_rng(11)
    params = tf.Variable(rng.standard_normal((5000, 24)), dtype=tf.float32)
    # Uneven bags (0 to 60 entries) with padding, so the blocks differ in size.
    lengths = rng.integers(0, 61, size=4000)
    values = rng.integers(-1, 5000, size=int(lengths.sum()))
    ids = tf.RaggedTensor.from_row_lengths(values, lengths)
    weight_values = tf.Variable(rng.random(values.size), dtype=tf.float32)
    upstream = tf.constant(rng.standard_normal((4000, 24)), tf.float32)
    for combiner in ("sum", "mean", "max"):
        for dense_grad in (False, True):
            with tf.GradientTape() as tape:
                w = None if combiner == "max" else ids.with_values(tf.identity(weight_values))
                out = tf_ttemb.gather_reduce_sum(
                    params, ids, w, combiner=combiner, padding_id=-1, dense_grad=dense_grad
                )
            sources = [params] if w is None else [params, weight_values]
            grads = tape.gradient(out, sources, output_gradients=upstream)
            digest.update(out.numpy().tobytes())
            for g in grads:
                digest.update(tf.convert_to_tensor(g).numpy().tobytes())
"""


@pytest.mark.slow
def test_cpu_results_have_the_same_bits_for_any_thread_count():
    """The CPU kernels split bags and id segments into blocks that any of the pool's
    threads (or the calling one) may claim: the forward, the deduplicated and dense
    gradients and the weights gradient have the same bits at 1, 2 and 3 threads."""
    digests = digests_at_thread_counts(THREADS_SCRIPT)
    assert len(set(digests.values())) == 1, digests


# TT factorisations (p, q, ranks) whose float32 products take every column block of the
# TT tiles (tt_embedding_cpu_math.h): widths q_k r_{k+1} of 8 to 168 (64-, 32-, 16- and
# 8-column blocks), contractions r_k of 8 to 56, the last core's q of 1 to 7 (RowDots's
# 4-output tiles and the rest) over odd and even row counts, and 2, 3 and 4 cores.
TT_SHAPES = [
    ([7, 9, 11], [4, 4, 4], [32, 32]),
    ([5, 6, 7], [3, 5, 3], [8, 24]),
    ([4, 5, 6], [2, 3, 5], [16, 56]),
    ([3, 4, 4, 5], [2, 2, 2, 3], [8, 16, 40]),
    ([9, 13], [4, 7], [16]),
    ([6, 7], [1, 1], [8]),
]

TT_SCRIPT = """
import json, sys
import numpy as np
import tensorflow as tf
from tf_ttemb.ops.tt_embedding import tt_rows

out_path, shapes = sys.argv[1], json.loads(sys.argv[2])
results = {}
for case, (p, q, ranks) in enumerate(shapes):
    rng = np.random.default_rng(case)
    r = [1] + ranks + [1]
    cores = [
        tf.Variable(rng.standard_normal((p[k], r[k] * q[k] * r[k + 1])), dtype=tf.float32)
        for k in range(len(p))
    ]
    # Duplicates and ids sharing leading digits: groups of many nodes, split in batches.
    ids = tf.constant(rng.integers(0, int(np.prod(p)), size=700), tf.int64)
    upstream = tf.constant(rng.standard_normal((700, int(np.prod(q)))), tf.float32)
    with tf.device("/CPU:0"):
        with tf.GradientTape() as tape:
            rows = tt_rows(cores, ids, p_shapes=p, q_shapes=q, ranks=ranks,
                           implementation="custom_op")
        grads = tape.gradient(rows, cores, output_gradients=upstream)
    results[f"{case}-rows"] = rows.numpy()
    for k, g in enumerate(grads):
        results[f"{case}-grad{k}"] = tf.convert_to_tensor(g).numpy()
np.savez(out_path, **results)
print("done")
"""


@pytest.fixture(scope="module")
def tt_both_paths(tmp_path_factory):
    """{"default" | "avx2": {key: array}}: the TT rows and core gradients of TT_SHAPES,
    each instruction set in a fresh process."""
    folder = tmp_path_factory.mktemp("tt_isa")
    outputs = {}
    for name in ("default", "avx2"):
        path = folder / f"{name}.npz"
        with pytest.MonkeyPatch.context() as patch:
            if name == "avx2":
                patch.setenv("TF_TTEMB_CPU_ISA", "avx2")
            else:
                patch.delenv("TF_TTEMB_CPU_ISA", raising=False)
            last = run_fresh_python(TT_SCRIPT, str(path), json.dumps(TT_SHAPES))
        assert last == "done", last
        outputs[name] = dict(np.load(pathlib.Path(path)))
    return outputs


@pytest.mark.parametrize("case", range(len(TT_SHAPES)))
def test_tt_products_agree_bitwise_on_both_instruction_sets(tt_both_paths, case):
    """The TT rows and every core's gradient have the same bits with the AVX-512 tiles
    and the AVX2 ones (every element is one fma chain in a fixed order), and the rows
    agree with the float64 reference."""
    from tf_ttemb import tt

    default, avx2 = tt_both_paths["default"], tt_both_paths["avx2"]
    keys = [key for key in default if key.startswith(f"{case}-")]
    assert len(keys) == len(TT_SHAPES[case][0]) + 1, keys
    for key in keys:
        np.testing.assert_array_equal(default[key], avx2[key], err_msg=key)
    p, q, ranks = TT_SHAPES[case]
    rng = np.random.default_rng(case)
    r = [1] + ranks + [1]
    cores = [
        rng.standard_normal((p[k], r[k] * q[k] * r[k + 1])).astype(np.float32)
        for k in range(len(p))
    ]
    ids = rng.integers(0, int(np.prod(p)), size=700)
    want = tt.rows([c.astype(np.float64) for c in cores], p, q, ranks, ids)
    np.testing.assert_allclose(
        default[f"{case}-rows"], want, rtol=0, atol=1e-4 * np.abs(want).max()
    )


@pytest.mark.skipif(
    __import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86-64 code only"
)
@pytest.mark.parametrize(
    "entry", ["RowsTimesAvx512<", "TransposedBlockAvx512<", "LeafGradientsAvx512<", "RowDotsAvx512"]
)
def test_tt_avx512_tiles_are_inlined_into_their_entry_points(entry):
    """The TT tiles are written once over a vector type; their AVX-512 instantiations
    work only when inlined into an AVX-512 function (TF_TTEMB_AVX512_FLATTEN, cpu_isa.h).
    Each entry point's body holds 512-bit fmas and calls nothing."""
    bodies = _disassembly(entry)
    bodies = {k: v for k, v in bodies.items() if not k.endswith("@plt")}
    assert bodies, f"no {entry} function in the op library"
    for name, body in bodies.items():
        assert "zmm" in body and "vfmadd" in body, name
        assert re.search(r"\bcall", body) is None, name
