"""tf_ttemb.tt_embedding_bag / tt_rows: lookups and gradients against a float64 numpy reference.

The reference table is `tf_ttemb.tt.to_dense` of the cores (float64), reduced by
`reference.forward`; the core gradients come from an independent numpy chain rule
(`core_grads_reference`) applied to `reference.params_grad`, the dense table gradient.
Both implementations are checked (the custom op once the op library has the TT ops).
"""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import (
    COMBINER_WEIGHTING,
    assert_close,
    combiner_id,
    dense_bags,
    dense_value,
    make_bags,
    make_upstream,
    ragged_bags,
    some_combiners,
    sparse_bags,
    weights_like,
)

import tf_ttemb
from tf_ttemb import tt
from tf_ttemb.ops import _loader
from tf_ttemb.ops import tt_embedding as tte

COMBINER_IDS = [combiner_id(v) for v in COMBINER_WEIGHTING]
FORMS = ("dense2d", "dense3d", "ragged", "sparse")


def tt_shape(n, p, q, ranks) -> dict:
    """The table's shape as `tt_embedding_bag` takes it, for a case (n, p, q, ranks) of CASES."""
    return dict(num_embeddings=n, p_shapes=p, q_shapes=q, ranks=ranks)


def _library_has(*names: str) -> bool:
    try:
        lib = _loader.load_op_library()
    except ImportError:
        return False
    return all(hasattr(lib, n) for n in names)


HAS_TT_OPS = _library_has("tf_ttemb_tt_unique_ids", "tf_ttemb_tt_rows", "tf_ttemb_tt_rows_grad")
HAS_CACHE_COUNT = _library_has("tf_ttemb_tt_cache_count")
needs_tt_ops = pytest.mark.skipif(not HAS_TT_OPS, reason="op library without the TT ops")
needs_cache_count = pytest.mark.skipif(
    not HAS_CACHE_COUNT, reason="op library without TTCacheCount"
)
IMPLEMENTATIONS = ["composite", pytest.param("custom_op", marks=needs_tt_ops)]
# What "auto" resolves to outside XLA once the ops exist; the composite before that.
DEFAULT_IMPLEMENTATION = "auto" if HAS_TT_OPS else "composite"

# name -> (N, p, q, inner ranks): 2, 3 and 4 cores, N below prod(p), dims 33, 3, 8 and 1.
CASES = {
    "2cores-d33": (20, [4, 5], [3, 11], [3]),
    "3cores-d3": (50, [3, 4, 5], [1, 3, 1], [2, 3]),
    "4cores-d8": (100, [2, 3, 4, 5], [2, 1, 2, 2], [2, 3, 2]),
    "3cores-d1": (7, [2, 2, 2], [1, 1, 1], [1, 2]),
}


# --------------------------------------------------------------------------------------
# Reference helpers (also used by test_tt_layers.py).
# --------------------------------------------------------------------------------------


def full_ranks(ranks):
    return [1] + list(ranks) + [1]


def random_cores(rng, p, q, ranks, num_tables=1):
    """float64 cores [num_tables * p_k, r_k q_k r_{k+1}] whose rows have entries of order 1."""
    r = full_ranks(ranks)
    return [
        rng.normal(size=(num_tables * p[k], r[k] * q[k] * r[k + 1])) / math.sqrt(r[k + 1])
        for k in range(len(p))
    ]


def dense_tables(cores, num_embeddings, p, q, ranks, num_tables=1):
    """[num_tables, N, D] float64 tables from tt.to_dense."""
    cores = [np.asarray(c, np.float64) for c in cores]
    return np.stack(
        [
            tt.to_dense(cores, p, q, ranks, num_embeddings, num_tables=num_tables, table=t)
            for t in range(num_tables)
        ]
    )


def magnitude_tables(cores, num_embeddings, p, q, ranks, num_tables=1):
    """Tables of the cores' absolute values: entrywise bounds of the terms summed in a row."""
    return dense_tables([np.abs(c) for c in cores], num_embeddings, p, q, ranks, num_tables)


def forward_reference(
    cores,
    num_embeddings,
    p,
    q,
    ranks,
    bags_like,
    weights,
    combiner,
    padding_id,
    table=0,
    num_tables=1,
):
    """Reference output [B, D] and an error scale that covers cancellation inside rows."""
    flat_ids, splits = bags_like
    tables = dense_tables(cores, num_embeddings, p, q, ranks, num_tables)
    magnitudes = magnitude_tables(cores, num_embeddings, p, q, ranks, num_tables)
    want, scale = reference.forward(tables[table], flat_ids, splits, weights, combiner, padding_id)
    abs_weights = None if weights is None else np.abs(weights)
    bound, _ = reference.forward(
        magnitudes[table],
        flat_ids,
        splits,
        abs_weights,
        "max" if combiner == "max" else combiner,
        padding_id,
    )
    return want, np.maximum(scale, bound)


def core_grads_reference(cores, p, q, ranks, ids, row_grads):
    """Dense gradients of the cores for gradients `row_grads` [n, D] of global rows `ids`.

    An independent chain rule: for row i with core rows c_k, the gradient of the block
    G_k[c_k] (r_k, q_k, r_{k+1}) is sum over the other columns of
    dRow[x, j, y] * Left_k[x, a] * Right_k[b, y], with Left_k the product of the blocks
    before k viewed (q_0..q_{k-1}, r_k) and Right_k those after k viewed (r_{k+1}, ...).
    """
    r = full_ranks(ranks)
    num_cores, big_p = len(p), math.prod(p)
    blocks = [
        np.asarray(c, np.float64).reshape(-1, r[k], q[k], r[k + 1]) for k, c in enumerate(cores)
    ]
    grads = [np.zeros(np.shape(c)) for c in cores]
    for g, row_grad in zip(np.asarray(ids).reshape(-1), np.asarray(row_grads, np.float64)):
        if not np.any(row_grad):
            continue
        table, i = divmod(int(g), big_p)
        rows = [table * p[k] + (i // math.prod(p[k + 1 :])) % p[k] for k in range(num_cores)]
        left = [np.ones((1, 1))]
        for k in range(num_cores - 1):
            step = np.einsum("xa,ajb->xjb", left[k], blocks[k][rows[k]])
            left.append(step.reshape(-1, r[k + 1]))
        right = [None] * num_cores
        right[-1] = np.ones((1, 1))
        for k in range(num_cores - 1, 0, -1):
            step = np.einsum("ajb,by->ajy", blocks[k][rows[k]], right[k])
            right[k - 1] = step.reshape(r[k], -1)
        for k in range(num_cores):
            d = row_grad.reshape(left[k].shape[0], q[k], right[k].shape[1])
            grads[k][rows[k]] += np.einsum("xa,xjy,by->ajb", left[k], d, right[k]).reshape(-1)
    return grads


def core_grad_scales(cores, p, q, ranks, ids, row_grad_scales):
    """Magnitude bounds for core gradients (the chain rule on |cores| and |grad|)."""
    return core_grads_reference([np.abs(c) for c in cores], p, q, ranks, ids, row_grad_scales)


def run_lookup(cores, ids, weights, upstream, mode="eager", **kwargs):
    """(output, core grads, weights grad) of sum(upstream * tt_embedding_bag(...))."""
    core_values = [tf.constant(c) for c in cores]

    def body(core_values, ids, weights, upstream):
        with tf.GradientTape() as tape:
            tape.watch(core_values)
            if weights is not None:
                tape.watch(weights)
            w = None if weights is None else weights_like(ids, weights)
            out = tf_ttemb.tt_embedding_bag(core_values, ids, w, **kwargs)
            loss = tf.reduce_sum(out * tf.cast(upstream, out.dtype))
        sources = core_values + ([weights] if weights is not None else [])
        return out, tape.gradient(loss, sources)

    if mode == "function":
        body = tf.function(body)
    elif mode == "jit":
        body = tf.function(body, jit_compile=True)
    out, grads = body(core_values, ids, weights, upstream)
    core_grads = grads[: len(cores)]
    return out, core_grads, (grads[-1] if weights is not None else None)


def check_lookup(
    rng,
    case,
    form,
    combiner,
    weighted,
    implementation,
    padding_id=-1,
    mode="eager",
    dtype=tf.float64,
    ids_dtype=tf.int64,
    grads=True,
):
    """Forward, core gradients and weights gradient against the float64 reference."""
    n, p, q, ranks = CASES[case]
    dim = math.prod(q)
    cores64 = random_cores(rng, p, q, ranks)
    cores = [tf.cast(tf.constant(c), dtype).numpy() for c in cores64]
    cores64 = [tf.cast(c, tf.float64).numpy() for c in cores]  # exactly the values used
    table = dense_tables(cores64, n, p, q, ranks)[0]
    bags = make_bags(rng, form, n, ids_dtype, padding_id=padding_id)
    w = w64 = None
    if weighted:
        csr = rng.uniform(0.5, 1.5, size=bags.nnz)
        w = tf.cast(tf.constant(bags.values_from_csr(csr)), dtype)
        w64 = bags.csr_from_values(tf.cast(w, tf.float64).numpy())
    up, up64 = make_upstream(rng, bags, dim, tf.float64)
    out, core_grads, w_grad = run_lookup(
        cores,
        bags.ids,
        w,
        up,
        mode,
        **tt_shape(n, p, q, ranks),
        combiner=combiner,
        padding_id=padding_id,
        implementation=implementation,
    )
    want, scale = forward_reference(
        cores64, n, p, q, ranks, (bags.flat_ids, bags.splits), w64, combiner, padding_id
    )
    assert out.dtype == dtype
    assert tuple(out.shape) == bags.lead_shape + (dim,)
    assert_close(dense_value(out).reshape(-1, dim), want, scale, dtype, "forward")
    if not grads:
        return
    dtable, dscale = reference.params_grad(
        table, bags.flat_ids, bags.splits, up64, w64, combiner, padding_id
    )
    want_grads = core_grads_reference(cores64, p, q, ranks, np.arange(n), dtable)
    scales = core_grad_scales(cores64, p, q, ranks, np.arange(n), dscale)
    for k, (got, want_k, scale_k) in enumerate(zip(core_grads, want_grads, scales)):
        assert got is not None, f"no gradient for core {k}"
        assert_close(dense_value(got), want_k, scale_k, dtype, f"core {k} grad")
    if weighted:
        want_w, scale_w = reference.weights_grad(
            table, bags.flat_ids, bags.splits, w64, up64, combiner, padding_id
        )
        assert_close(bags.csr_from_values(dense_value(w_grad)), want_w, scale_w, dtype, "w grad")


# --------------------------------------------------------------------------------------
# Lookups and gradients.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
def test_every_combiner_and_form(rng, combiner, weighted, form, implementation):
    check_lookup(rng, "3cores-d3", form, combiner, weighted, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
@some_combiners("sum-weighted", "sqrtn-weighted", "max")
def test_core_counts_and_odd_dims(rng, case, combiner, weighted, implementation):
    check_lookup(rng, case, "ragged", combiner, weighted, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("padding_id", [None, 0, 6], ids=lambda v: f"pad{v}")
@pytest.mark.parametrize("ids_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
def test_padding_and_id_dtypes(rng, padding_id, ids_dtype, implementation):
    check_lookup(
        rng,
        "3cores-d1",
        "dense2d",
        "mean",
        True,
        implementation,
        padding_id=padding_id,
        ids_dtype=ids_dtype,
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
def test_in_tf_function(rng, form, implementation):
    check_lookup(rng, "4cores-d8", form, "mean", True, implementation, mode="function")


@pytest.mark.parametrize("form", ["dense3d", "ragged"])
@pytest.mark.parametrize(
    "combiner,weighted", [("sum", True), ("max", False)], ids=["sum-weighted", "max"]
)
def test_jit_compile_auto_picks_the_composite(rng, form, combiner, weighted):
    check_lookup(rng, "2cores-d33", form, combiner, weighted, "auto", mode="jit")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32], ids=lambda d: d.name)
def test_value_dtypes(rng, dtype, implementation):
    check_lookup(
        rng,
        "3cores-d3",
        "ragged",
        "sqrtn",
        True,
        implementation,
        dtype=dtype,
        grads=dtype == tf.float32,
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_compute_gradient_float64(rng, implementation):
    """tf.test.compute_gradient (finite differences) w.r.t. every core and the weights."""
    n, p, q, ranks = CASES["3cores-d1"]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks)]
    bags = ragged_bags(rng, [3, 0, 4, 2], n, tf.int64, padding_id=-1)
    w = tf.constant(rng.uniform(0.5, 1.5, size=bags.nnz))

    def f(*args):
        return tf_ttemb.tt_embedding_bag(
            list(args[:-1]),
            bags.ids,
            bags.ids.with_flat_values(args[-1]),
            **tt_shape(n, p, q, ranks),
            combiner="sum",
            padding_id=-1,
            implementation=implementation,
        )

    theoretical, numerical = tf.test.compute_gradient(f, cores + [w])
    for k, (a, b) in enumerate(zip(theoretical, numerical)):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9, err_msg=f"input {k}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "max"])
def test_empty_batch_and_empty_bags(rng, form, combiner, implementation):
    n, p, q, ranks = CASES["3cores-d3"]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks)]
    kwargs = dict(
        **tt_shape(n, p, q, ranks),
        combiner=combiner,
        padding_id=-1,
        implementation=implementation,
    )
    if form == "dense2d":
        batches = [tf.zeros([0, 3], tf.int64), tf.fill([2, 3], tf.constant(-1, tf.int64))]
    elif form == "ragged":
        batches = [ragged_bags(rng, [], n, tf.int64).ids, ragged_bags(rng, [0, 0], n, tf.int64).ids]
    else:
        batches = [sparse_bags(rng, [], n, tf.int64).ids, sparse_bags(rng, [0, 0], n, tf.int64).ids]
    for ids in batches:
        with tf.GradientTape() as tape:
            tape.watch(cores)
            out = tf_ttemb.tt_embedding_bag(cores, ids, **kwargs)
        num_bags = 0 if ids.shape[0] == 0 else 2
        assert tuple(out.shape) == (num_bags, 3)
        np.testing.assert_array_equal(out.numpy(), 0.0)
        for g in tape.gradient(out, cores):
            assert g is None or not np.any(dense_value(g))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_core_gradients_are_indexed_slices(rng, implementation):
    n, p, q, ranks = CASES["3cores-d3"]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks)]
    ids = tf.constant([[0, 49, 49], [13, 0, 7]], tf.int64)
    with tf.GradientTape() as tape:
        tape.watch(cores)
        out = tf_ttemb.tt_embedding_bag(
            cores,
            ids,
            **tt_shape(n, p, q, ranks),
            implementation=implementation,
        )
    for k, g in enumerate(tape.gradient(out, cores, output_gradients=tf.ones_like(out))):
        assert isinstance(g, tf.IndexedSlices), type(g)
        assert tuple(g.dense_shape.numpy()) == tuple(cores[k].shape)
        if implementation == "custom_op":  # sorted distinct core rows, from TTRowsGrad
            indices = g.indices.numpy()
            np.testing.assert_array_equal(indices, np.unique(indices))


@pytest.mark.parametrize("num_tables", [1, 2])
def test_table_splits_are_computed_on_the_host(rng, num_tables):
    # TTUniqueIds reads table_splits in host memory: every op between the ids' Shape and
    # it is placed on the host CPU, so that a GPU step makes no copy to the device and
    # back for them (which would wait for the kernels queued before).
    n, p, q, ranks = CASES["3cores-d3"]
    cores = [tf.constant(np.tile(c, (num_tables, 1))) for c in random_cores(rng, p, q, ranks)]
    ids = tf.constant(rng.integers(0, n, size=(num_tables, 4, 3)) if num_tables > 1 else [[1, 2]])

    @tf.function
    def lookup(ids):
        return tf_ttemb.tt_embedding_bag(
            cores, ids, **tt_shape(n, p, q, ranks), num_tables=num_tables
        )

    graph = lookup.get_concrete_function(ids).graph
    unique = [op for op in graph.get_operations() if op.type == "TfTtemb>TTUniqueIds"]
    assert len(unique) == 1, sorted({op.type for op in graph.get_operations()})
    table_splits = unique[0].inputs[1]  # (ids, table_splits)
    pending, seen, placed = [table_splits.op], set(), []
    while pending:
        op = pending.pop()
        if op.name in seen or op.type in ("Shape", "Const", "Placeholder"):
            continue
        seen.add(op.name)
        placed.append((op.type, tf.DeviceSpec.from_string(op.device).device_type))
        pending.extend(t.op for t in op.inputs)
    assert placed and all(device == "CPU" for _, device in placed), placed


# --------------------------------------------------------------------------------------
# Several tables in one call.
# --------------------------------------------------------------------------------------

NUM_TABLES = 3


def _table_inputs(rng, form, n, ids_dtype=tf.int64):
    """(indices as the op takes them, list of per-table Bags)."""
    if form == "dense":
        bags = dense_bags(rng, (NUM_TABLES, 4, 3), n, ids_dtype, padding_id=-1)
        per_table = [
            dense_bags(rng, None, n, ids_dtype, ids=bags.ids.numpy()[t]) for t in range(NUM_TABLES)
        ]
        return bags.ids, per_table
    per_table = []
    for _ in range(NUM_TABLES):
        lengths = rng.integers(0, 5, size=4)
        if form == "list-ragged":
            per_table.append(ragged_bags(rng, lengths, n, ids_dtype, padding_id=-1))
        elif form == "list-sparse":
            per_table.append(sparse_bags(rng, lengths, n, ids_dtype, padding_id=-1))
        else:
            per_table.append(dense_bags(rng, (4, 3), n, ids_dtype, padding_id=-1))
    return [b.ids for b in per_table], per_table


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", ["dense", "list-ragged", "list-sparse", "list-dense"])
@some_combiners("sum-weighted", "mean", "max")
def test_table_batched(rng, form, combiner, weighted, implementation):
    n, p, q, ranks = CASES["3cores-d3"]
    dim = math.prod(q)
    cores = random_cores(rng, p, q, ranks, NUM_TABLES)
    tables = dense_tables(cores, n, p, q, ranks, NUM_TABLES)
    indices, per_table = _table_inputs(rng, form, n)
    w64 = weights = None
    if weighted:
        w64 = [rng.uniform(0.5, 1.5, size=b.nnz) for b in per_table]
        values = [tf.constant(b.values_from_csr(w)) for b, w in zip(per_table, w64)]
        if form == "dense":
            weights = tf.stack(values)
        else:
            weights = [weights_like(b.ids, v) for b, v in zip(per_table, values)]
    up = rng.normal(size=(NUM_TABLES, 4, dim))
    core_values = [tf.constant(c) for c in cores]
    with tf.GradientTape() as tape:
        tape.watch(core_values)
        out = tf_ttemb.tt_embedding_bag(
            core_values,
            indices,
            weights,
            **tt_shape(n, p, q, ranks),
            num_tables=NUM_TABLES,
            combiner=combiner,
            padding_id=-1,
            implementation=implementation,
        )
        loss = tf.reduce_sum(out * up)
    assert tuple(out.shape) == (NUM_TABLES, 4, dim)
    grads = tape.gradient(loss, core_values)
    global_ids, row_grads, row_scales = [], [], []
    for t, bags in enumerate(per_table):
        wt = None if w64 is None else w64[t]
        want, scale = reference.forward(tables[t], bags.flat_ids, bags.splits, wt, combiner, -1)
        assert_close(out.numpy()[t], want, scale, tf.float64, f"table {t}")
        dtable, dscale = reference.params_grad(
            tables[t], bags.flat_ids, bags.splits, up[t], wt, combiner, -1
        )
        global_ids.append(t * math.prod(p) + np.arange(n))
        row_grads.append(dtable)
        row_scales.append(dscale)
    ids = np.concatenate(global_ids)
    want = core_grads_reference(cores, p, q, ranks, ids, np.concatenate(row_grads))
    scales = core_grad_scales(cores, p, q, ranks, ids, np.concatenate(row_scales))
    for k in range(len(cores)):
        assert_close(dense_value(grads[k]), want[k], scales[k], tf.float64, f"core {k} grad")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_table_batched_list_of_mixed_forms(rng, implementation):
    n, p, q, ranks = CASES["2cores-d33"]
    cores = random_cores(rng, p, q, ranks, 2)
    tables = dense_tables(cores, n, p, q, ranks, 2)
    ragged = ragged_bags(rng, [2, 0, 3], n, tf.int32)
    sparse = sparse_bags(rng, [1, 4, 0], n, tf.int64)
    out = tf_ttemb.tt_embedding_bag(
        [tf.constant(c) for c in cores],
        [ragged.ids, sparse.ids],
        **tt_shape(n, p, q, ranks),
        num_tables=2,
        implementation=implementation,
    )
    for t, bags in enumerate([ragged, sparse]):
        want, scale = reference.forward(tables[t], bags.flat_ids, bags.splits)
        assert_close(out.numpy()[t], want, scale, tf.float64, f"table {t}")


# --------------------------------------------------------------------------------------
# Cache.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,implementation",
    # The custom op does not compile under XLA (jit runs the composite under "auto").
    [
        pytest.param(m, i, marks=needs_tt_ops if i == "custom_op" else ())
        for m in ("eager", "function", "jit")
        for i in ("composite", "custom_op")
        if not (m == "jit" and i == "custom_op")
    ],
)
@some_combiners("sum-weighted", "sqrtn", "max")
def test_cache_rows_replace_the_cores(rng, combiner, weighted, implementation, mode):
    """Cached ids read (and train) cache_rows; the cores get only the other ids' gradient."""
    n, p, q, ranks = CASES["3cores-d3"]
    dim = math.prod(q)
    cores = random_cores(rng, p, q, ranks, 2)
    tables = dense_tables(cores, n, p, q, ranks, 2)
    big_p = math.prod(p)
    cached = np.sort(rng.choice(2 * n, size=9, replace=False))
    cached = np.where(cached >= n, cached - n + big_p, cached)  # global ids of both tables
    size = 12
    cache_ids = np.concatenate([cached, np.full(size - len(cached), tte.EMPTY_CACHE_ID)])
    cache_rows = rng.normal(size=(size, dim))
    effective = tables.copy()
    for slot, g in enumerate(cached):
        effective[g // big_p, g % big_p] = cache_rows[slot]
    ids = rng.integers(0, n, size=(2, 5, 4))
    w = rng.uniform(0.5, 1.5, size=ids.shape) if weighted else None
    up = rng.normal(size=(2, 5, dim))
    core_values = [tf.constant(c) for c in cores]
    rows_value = tf.constant(cache_rows)

    def body(core_values, rows_value):
        with tf.GradientTape() as tape:
            tape.watch([core_values, rows_value])
            out = tf_ttemb.tt_embedding_bag(
                core_values,
                tf.constant(ids),
                None if w is None else tf.constant(w),
                **tt_shape(n, p, q, ranks),
                num_tables=2,
                combiner=combiner,
                cache_ids=tf.constant(cache_ids),
                cache_rows=rows_value,
                implementation=implementation,
            )
            loss = tf.reduce_sum(out * up)
        core_grads, rows_grad = tape.gradient(loss, [core_values, rows_value])
        return out, [tf.convert_to_tensor(g) for g in core_grads], tf.convert_to_tensor(rows_grad)

    if mode != "eager":
        body = tf.function(body, jit_compile=mode == "jit")
    out, core_grads, rows_grad = body(core_values, rows_value)
    row_grads, row_scales = [], []
    for t in range(2):
        splits = np.arange(6) * 4
        wt = None if w is None else w[t].reshape(-1)
        want, scale = reference.forward(effective[t], ids[t].reshape(-1), splits, wt, combiner)
        assert_close(out.numpy()[t], want, scale, tf.float64, f"table {t}")
        dtable, dscale = reference.params_grad(
            effective[t], ids[t].reshape(-1), splits, up[t], wt, combiner
        )
        row_grads.append(dtable)
        row_scales.append(dscale)
    global_ids = np.concatenate([np.arange(n), big_p + np.arange(n)])
    row_grads, row_scales = np.concatenate(row_grads), np.concatenate(row_scales)
    cached_rows = np.searchsorted(global_ids, cached)
    want_rows_grad = np.zeros_like(cache_rows)
    want_rows_grad[: len(cached)] = row_grads[cached_rows]
    assert_close(rows_grad.numpy(), want_rows_grad, np.abs(want_rows_grad), tf.float64, "rows")
    row_grads[cached_rows] = 0.0  # no core gradient from cached ids
    want = core_grads_reference(cores, p, q, ranks, global_ids, row_grads)
    scales = core_grad_scales(cores, p, q, ranks, global_ids, row_scales)
    for k in range(len(cores)):
        assert_close(core_grads[k].numpy(), want[k], scales[k], tf.float64, f"core {k} grad")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_cache_rows_variable_gets_indexed_slices(rng, implementation):
    n, p, q, ranks = CASES["2cores-d33"]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks)]
    rows = tf.Variable(rng.normal(size=(4, 33)))
    cache_ids = tf.constant([3, 9, tte.EMPTY_CACHE_ID, tte.EMPTY_CACHE_ID], tf.int64)
    with tf.GradientTape() as tape:
        out = tf_ttemb.tt_embedding_bag(
            cores,
            tf.constant([[3, 4], [9, 9]]),
            **tt_shape(n, p, q, ranks),
            cache_ids=cache_ids,
            cache_rows=rows,
            implementation=implementation,
        )
    grad = tape.gradient(out, rows, output_gradients=tf.ones_like(out))
    assert isinstance(grad, tf.IndexedSlices)
    np.testing.assert_array_equal(dense_value(grad)[:, 0], [1.0, 2.0, 0.0, 0.0])


# --------------------------------------------------------------------------------------
# tt_rows.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_tt_rows(rng, case, implementation):
    n, p, q, ranks = CASES[case]
    cores = random_cores(rng, p, q, ranks, 2)
    ids = rng.integers(0, 2 * math.prod(p), size=17)  # any order, duplicates, rows >= N
    core_values = [tf.constant(c) for c in cores]
    up = rng.normal(size=(17, math.prod(q)))
    with tf.GradientTape() as tape:
        tape.watch(core_values)
        rows = tf_ttemb.tt_rows(
            core_values,
            tf.constant(ids, tf.int32),
            p_shapes=p,
            q_shapes=q,
            ranks=ranks,
            num_tables=2,
            implementation=implementation,
        )
        loss = tf.reduce_sum(rows * up)
    want = tt.rows(cores, p, q, ranks, ids, num_tables=2)
    np.testing.assert_allclose(rows.numpy(), want, rtol=1e-12, atol=1e-12)
    want_grads = core_grads_reference(cores, p, q, ranks, ids, up)
    for k, g in enumerate(tape.gradient(loss, core_values)):
        np.testing.assert_allclose(dense_value(g), want_grads[k], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_tt_rows_out_of_range(rng, implementation, mode):
    n, p, q, ranks = CASES["2cores-d33"]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks)]

    def f(ids):
        return tf_ttemb.tt_rows(
            cores, ids, p_shapes=p, q_shapes=q, ranks=ranks, implementation=implementation
        )

    if mode == "function":
        f = tf.function(f)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"ids\[2\] = 20 is not in \[0, 20\)"):
        f(tf.constant([0, 19, 20, -1], tf.int64))


# --------------------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "case,message",
    [
        ("above", r"indices\[4\] = 50 is not in \[0, 50\)"),  # in [N, prod(p)): rejected
        ("negative", r"indices\[1\] = -2 is not in \[0, 50\) and is not padding_id \(-1\)"),
        ("far", r"indices\[5\] = 9001 is not in \[0, 50\)"),
        ("list", r"indices\[6\] = 55 is not in \[0, 50\)"),  # flat over the concatenated tables
    ],
)
def test_ids_out_of_range(rng, case, message, implementation, mode):
    n, p, q, ranks = CASES["3cores-d3"]
    num_tables = 2 if case == "list" else 1
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, num_tables)]
    padding_id = -1 if case == "negative" else None
    if case == "above":
        ids = tf.constant([[0, 1, 2], [3, 50, 4]])
    elif case == "negative":
        ids = tf.ragged.constant([[0, -2], [-1]], dtype=tf.int64)
    elif case == "far":
        ids = tf.constant([[0, 1, 2], [3, 4, 9001]], tf.int64)
    else:
        ids = [tf.ragged.constant([[1, 2], [3, 4]]), tf.ragged.constant([[5, 6], [55]])]

    def f():
        return tf_ttemb.tt_embedding_bag(
            cores,
            ids,
            **tt_shape(n, p, q, ranks),
            num_tables=num_tables,
            padding_id=padding_id,
            implementation=implementation,
        )

    if mode == "function":
        f = tf.function(f)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        f()


def _args(**overrides):
    n, p, q, ranks = CASES["3cores-d3"]
    args = dict(num_embeddings=n, p_shapes=p, q_shapes=q, ranks=ranks)
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,error,pattern",
    [
        (dict(p_shapes=[3, 4, 4]), ValueError, r"prod\(p_shapes\) = 48 .* >= num_embeddings = 50"),
        (dict(ranks=[2]), ValueError, r"ranks must have 2 entries .* got \[2\]"),
        (dict(ranks=[2, 0]), ValueError, r"ranks must be a list of integers >= 1, got \[2, 0\]"),
        (dict(q_shapes=[1, 3]), ValueError, r"q_shapes must have as many factors .* got \[1, 3\]"),
        (dict(p_shapes=[60], q_shapes=[3], ranks=[]), ValueError, r"at least 2 factors.*\[60\]"),
        (dict(num_embeddings=0), ValueError, r"num_embeddings must be an integer >= 1, got 0"),
        (dict(num_tables=2), ValueError, r"cores\[0\] must have shape .* \[6, 2\], got \[3, 2\]"),
        (dict(combiner="avg"), ValueError, r"combiner must be one of .* got 'avg'"),
        (dict(implementation="fast"), ValueError, r"implementation must be one of .* got 'fast'"),
        (dict(padding_id="x"), ValueError, r"padding_id must be an integer or None, got 'x'"),
        (dict(cache_ids=tf.constant([1], tf.int64)), ValueError, r"given together"),
        (
            dict(cache_ids=tf.constant([1], tf.int32), cache_rows=tf.zeros([1, 3], tf.float64)),
            TypeError,
            r"cache_ids must be int64, got int32",
        ),
        (
            dict(cache_ids=tf.constant([1], tf.int64), cache_rows=tf.zeros([1, 3], tf.float32)),
            TypeError,
            r"cache_rows must have the cores' dtype float64, got float32",
        ),
        (
            dict(cache_ids=tf.constant([1, 2], tf.int64), cache_rows=tf.zeros([2, 4], tf.float64)),
            ValueError,
            r"cache_rows must be \[C, D\] = \[2, 3\]",
        ),
    ],
    ids=lambda v: None if not isinstance(v, str) else v[:30],
)
def test_argument_errors(rng, overrides, error, pattern):
    n, p, q, ranks = CASES["3cores-d3"]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks)]
    with pytest.raises(error, match=pattern):
        tf_ttemb.tt_embedding_bag(cores, tf.constant([[1, 2]]), **_args(**overrides))


def test_core_errors(rng):
    n, p, q, ranks = CASES["3cores-d3"]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks)]
    ids = tf.constant([[1, 2]])
    with pytest.raises(ValueError, match=r"cores must hold 3 cores .* got 2"):
        tf_ttemb.tt_embedding_bag(cores[:2], ids, **_args())
    with pytest.raises(ValueError, match=r"cores\[1\] must have shape .* \[4, 18\], got \[4, 17\]"):
        tf_ttemb.tt_embedding_bag([cores[0], cores[1][:, :17], cores[2]], ids, **_args())
    with pytest.raises(TypeError, match=r"one dtype, got float64 for cores\[0\] and float32"):
        tf_ttemb.tt_embedding_bag(
            [cores[0], tf.cast(cores[1], tf.float32), cores[2]], ids, **_args()
        )
    with pytest.raises(ValueError, match="'max' does not take weights"):
        tf_ttemb.tt_embedding_bag(
            cores, ids, tf.ones([1, 2], tf.float64), combiner="max", **_args()
        )


def test_table_input_errors(rng):
    n, p, q, ranks = CASES["3cores-d3"]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 2)]
    args = _args(num_tables=2)
    ragged = tf.ragged.constant([[1], [2, 3]])
    with pytest.raises(ValueError, match=r"one entry per table \(2\), got 3"):
        tf_ttemb.tt_embedding_bag(cores, [ragged] * 3, **args)
    with pytest.raises(ValueError, match=r"must be a list of 2 tensors .* got one RaggedTensor"):
        tf_ttemb.tt_embedding_bag(cores, ragged, **args)
    with pytest.raises(ValueError, match=r"\[num_tables = 2, \.\.\., L\], got a leading .* 3"):
        tf_ttemb.tt_embedding_bag(cores, tf.zeros([3, 2, 2], tf.int64), **args)
    with pytest.raises(tf.errors.InvalidArgumentError, match="same number of bags"):
        tf_ttemb.tt_embedding_bag(cores, [ragged, tf.ragged.constant([[1]])], **args)


def test_docstring_examples():
    for module in (tte,):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, f"{result.failed} doctest failures in {module.__name__}"
        assert result.attempted > 0
