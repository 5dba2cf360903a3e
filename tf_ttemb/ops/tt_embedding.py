"""`tt_embedding_bag`: EmbeddingBag over a Tensor-Train (TT) compressed table.

A table of `num_embeddings` (N) rows and `D = prod(q_shapes)` columns is stored as
`T >= 2` cores; core k is `[num_tables * p_k, r_k * q_k * r_{k+1}]` (see
`docs/tt_embedding_contract.md` for the layout, the digit order and global ids).
Only the rows a batch uses are ever decompressed.

Two implementations compute the same numbers and gradients:

* `custom_op`: `TTUniqueIds` → `TTRows` (each distinct id of the batch once) →
  `gather_reduce_sum(rows, slots, ...)`, backward through `TTRowsGrad` (one
  `tf.IndexedSlices` per core over the core rows the batch touched, deterministic).
* `composite`: plain TensorFlow ops (gathers of core rows and batched matmuls); it
  compiles under XLA and runs on TPU. Outside XLA it decompresses each distinct id once;
  under XLA every entry (no `tf.unique` there). Gradients by autodiff.

An optional row cache (`cache_ids` sorted, `cache_rows`) serves the ids it holds from
`cache_rows` instead of the cores (their gradient then goes to `cache_rows`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from tf_ttemb import _args
from tf_ttemb.ops import _bags, _common, _custom_op, _loader, composite

# Marks an empty cache slot in `cache_ids` (larger than every valid global id, so the
# sorted cache ids keep empty slots at the end).
EMPTY_CACHE_ID = 2**63 - 1

IndicesLike = _common.IndicesLike


class TTShape(NamedTuple):
    """A checked TT factorisation (all plain Python ints)."""

    num_embeddings: int  # N
    p: tuple  # [T] row factors, prod >= N
    q: tuple  # [T] column factors, prod == D
    r: tuple  # [T + 1] ranks with r_0 = r_T = 1
    num_tables: int

    @property
    def num_cores(self) -> int:
        return len(self.p)

    @property
    def rows_per_table(self) -> int:  # P = prod(p), the stride of global ids
        return math.prod(self.p)

    @property
    def dim(self) -> int:
        return math.prod(self.q)

    @property
    def ranks(self) -> list:  # the inner ranks r_1..r_{T-1}, as the ops' attr
        return list(self.r[1:-1])

    def core_shape(self, k: int) -> tuple:
        return (self.num_tables * self.p[k], self.r[k] * self.q[k] * self.r[k + 1])

    def digit_stride(self, k: int) -> int:  # L_k = prod_{j > k} p_j
        return math.prod(self.p[k + 1 :])

    def op_attrs(self) -> dict:
        return {
            "p_shapes": list(self.p),
            "q_shapes": list(self.q),
            "ranks": self.ranks,
            "num_tables": self.num_tables,
        }


def _int_list(name: str, values: Any, minimum: int = 1) -> tuple:
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        out = []
        for v in values:
            if isinstance(v, bool):
                raise TypeError
            out.append(operator.index(v))
    except TypeError:
        out = None
    if out is None or any(v < minimum for v in out):
        raise ValueError(f"{name} must be a list of integers >= {minimum}, got {values!r}")
    return tuple(out)


def check_shapes(
    num_embeddings: int, p_shapes: Any, q_shapes: Any, ranks: Any, num_tables: int = 1
) -> TTShape:
    """Checks a TT factorisation and returns it as a `TTShape`.

    Raises:
      ValueError: quoting the offending values, when a factor or rank is not a positive
        integer, the lists' lengths disagree (T >= 2 cores, T - 1 ranks) or
        `prod(p_shapes) < num_embeddings`.
    """
    num_embeddings = _args.positive_int("num_embeddings", num_embeddings)
    num_tables = _args.positive_int("num_tables", num_tables)
    p = _int_list("p_shapes", p_shapes)
    q = _int_list("q_shapes", q_shapes)
    inner = _int_list("ranks", ranks)
    if len(p) < 2:
        raise ValueError(f"p_shapes needs at least 2 factors (2 cores), got {list(p)}")
    if len(q) != len(p):
        raise ValueError(
            f"q_shapes must have as many factors as p_shapes ({len(p)}), got {list(q)}"
        )
    if len(inner) != len(p) - 1:
        raise ValueError(
            f"ranks must have {len(p) - 1} entries (one between each pair of the "
            f"{len(p)} cores), got {list(inner)}"
        )
    if math.prod(p) < num_embeddings:
        raise ValueError(
            f"prod(p_shapes) = {math.prod(p)} (p_shapes {list(p)}) must be >= "
            f"num_embeddings = {num_embeddings}"
        )
    return TTShape(num_embeddings, p, q, (1,) + inner + (1,), num_tables)


def _check_cores(cores: Any, shape: TTShape) -> list:
    """Checks the cores' count, static shapes and dtype; returns them as a list."""
    if isinstance(cores, (tf.Tensor, tf.Variable)) or not isinstance(cores, Sequence):
        raise ValueError(
            f"cores must be a list of {shape.num_cores} tensors or variables, got "
            f"{type(cores).__name__}"
        )
    cores = list(cores)
    if len(cores) != shape.num_cores:
        raise ValueError(
            f"cores must hold {shape.num_cores} cores (one per factor of p_shapes "
            f"{list(shape.p)}), got {len(cores)}"
        )
    dtype = None
    for k, core in enumerate(cores):
        if not hasattr(core, "dtype") or not hasattr(core, "shape"):
            core = cores[k] = tf.convert_to_tensor(core)
        core_dtype = tf.as_dtype(core.dtype)
        if core_dtype not in _common.VALUE_TYPES:
            raise TypeError(
                f"cores must be float16, bfloat16, float32 or float64, got {core_dtype.name} "
                f"for cores[{k}]"
            )
        if dtype is None:
            dtype = core_dtype
        elif core_dtype != dtype:
            raise TypeError(
                f"all cores must have one dtype, got {dtype.name} for cores[0] and "
                f"{core_dtype.name} for cores[{k}]"
            )
        want = shape.core_shape(k)
        got = tf.TensorShape(core.shape)
        if not got.is_compatible_with(want):
            raise ValueError(
                f"cores[{k}] must have shape [num_tables * p_{k}, r_{k} * q_{k} * r_{k + 1}] = "
                f"{list(want)}, got {got.as_list() if got.rank is not None else got}"
            )
    return cores


def _tt_library(implementation: str):
    lib = _loader.load_op_library()
    if not hasattr(lib, "tf_ttemb_tt_rows"):
        raise _loader.OpLibraryNotFoundError(
            f"The op library {_loader.LIBRARY_PATH} has no TT ops (TTRows, ...): it predates "
            "them. Rebuild it with `bash configure.sh` (or pass implementation='composite', "
            f"which needs no op library); implementation was {implementation!r}."
        )
    return lib


def _choose(implementation: str, probe: Any) -> tuple[str, bool]:
    """(resolved implementation, whether XLA/TPU semantics apply)."""
    _args.check_choice("implementation", implementation, _common.IMPLEMENTATIONS)
    xla = _common.in_xla_context() or _common.on_tpu(probe)
    if implementation == "auto":
        implementation = "composite" if xla else "custom_op"
    return implementation, xla


# ----------------------------------------------------------------------------------------
# Rows of global ids.


def _shape_checked_cores(cores: list, shape: TTShape, xla: bool) -> list:
    """The cores, each whose static shape is not fully known (a variable made with
    validate_shape=False, a traced placeholder) checked at run time against the shape it
    must have, with the custom op's message. Under XLA assertions compile away: the
    composite would then compute from whatever the core holds."""
    if xla:
        return list(cores)
    checked = []
    for k, core in enumerate(cores):
        if tf.TensorShape(core.shape).is_fully_defined():
            checked.append(core)
            continue
        want = shape.core_shape(k)
        check = tf.debugging.assert_equal(
            tf.shape(core, out_type=tf.int64),
            tf.constant(want, tf.int64),
            message=(
                f"cores[{k}] must be [num_tables * p_shapes[{k}], r_{k} * q_{k} * r_{k + 1}] = "
                f"[{want[0]}, {want[1]}]"
            ),
        )
        with tf.control_dependencies([check]):
            checked.append(tf.identity(core))
    return checked


def _composite_rows(cores: list, ids: tf.Tensor, shape: TTShape) -> tf.Tensor:
    """Rows [n, D] of global ids [n] (int64, in range) from gathers and batched matmuls.

    P_0 = G_0[i_0] viewed (q_0, r_1); P_t = P_{t-1} @ G_t[i_t] viewed (r_t, q_t r_{t+1}),
    the result viewed (q_0..q_t, r_{t+1}); the row is P_{T-1} flattened. Half types
    compute in float32 and return rows in their dtype.
    """
    dtype = tf.as_dtype(cores[0].dtype)
    compute = _common.accumulation_dtype(dtype)
    stride = shape.rows_per_table
    table = ids // stride
    local = ids % stride

    def core_rows(k: int) -> tf.Tensor:
        core_row = table * shape.p[k] + (local // shape.digit_stride(k)) % shape.p[k]
        return tf.cast(tf.gather(cores[k], core_row), compute)  # [n, r_k q_k r_{k+1}]

    n = tf.shape(ids)[0]
    product = tf.reshape(core_rows(0), tf.stack([n, shape.q[0], shape.r[1]]))
    cols = shape.q[0]
    for k in range(1, shape.num_cores):
        block = tf.reshape(core_rows(k), tf.stack([n, shape.r[k], shape.q[k] * shape.r[k + 1]]))
        cols *= shape.q[k]
        product = tf.reshape(tf.matmul(product, block), tf.stack([n, cols, shape.r[k + 1]]))
    rows = tf.reshape(product, tf.stack([n, shape.dim]))
    rows.set_shape([ids.shape[0], shape.dim])
    return tf.cast(rows, dtype)


def _custom_rows(lib, cores: list, ids: tf.Tensor, shape: TTShape, ids_checked=False):
    """`TTRows`, and the check of its report where TensorFlow sees a GPU.

    The GPU kernel returns without waiting for the device; what it found wrong in the
    ids is in its `report` output, which `CheckTTRowsReport` raises the CPU kernel's
    InvalidArgument from, off the path of the rows' consumers (`_common.after_checks`).
    `ids_checked`: the ids come from `TTUniqueIds`, which checked them, so no check is
    added. Without a GPU the CPU kernel checks on its own and its report is empty.
    """
    rows, _, report = lib.tf_ttemb_tt_rows(
        ids, [tf.convert_to_tensor(c) for c in cores], **shape.op_attrs()
    )
    if ids_checked or not _common.gpus_visible():
        return rows
    limit = shape.num_tables * shape.rows_per_table
    return _common.after_checks([lib.tf_ttemb_check_tt_rows_report(report, limit=limit)], rows)


@tf.RegisterGradient("TfTtemb>TTRows")
def _tt_rows_grad(op, grad, unused_saved_grad, unused_report_grad):
    """Gradient of TTRows: none for the ids, one IndexedSlices per core (from TTRowsGrad)."""
    lib = _loader.load_op_library()
    num_cores = op.get_attr("num_cores")
    ids = op.inputs[0]
    cores = list(op.inputs[1 : 1 + num_cores])
    attrs = {k: op.get_attr(k) for k in ("p_shapes", "q_shapes", "ranks", "num_tables")}
    # TTRowsGrad recomputes the partial products; its `saved` input is TTRows' empty
    # second output, kept in both ops' signatures.
    indices, values = lib.tf_ttemb_tt_rows_grad(
        ids, cores, tf.convert_to_tensor(grad), op.outputs[1], **attrs
    )
    core_grads = [
        tf.IndexedSlices(v, i, dense_shape=tf.shape(c, out_type=tf.int64))
        for i, v, c in zip(indices, values, cores)
    ]
    return [None] + core_grads


tf.no_gradient("TfTtemb>TTUniqueIds")
tf.no_gradient("TfTtemb>TTRowsGrad")
tf.no_gradient("TfTtemb>TTRowsBagsGrad")
tf.no_gradient("TfTtemb>TTCacheCount")
tf.no_gradient("TfTtemb>CheckTTRowsReport")


def _read_rows(table: Any, positions: tf.Tensor) -> tf.Tensor:
    """Rows of a tensor or variable (a sparse read: the gradient is IndexedSlices)."""
    variable = _common.resource_variable(table)
    if variable is not None:
        return variable.sparse_read(positions)
    return tf.gather(table, positions)


def rows_with_cache(
    ids: tf.Tensor, compute_rows, cache_ids: Any, cache_rows: Any, xla: bool
) -> tf.Tensor:
    """Rows of global ids [U]: cached ones from `cache_rows`, the others computed.

    On the CPU only the misses are computed (combined with `tf.dynamic_stitch`). Under
    XLA (static shapes) and where TensorFlow sees a GPU, every id is computed and the hits
    are selected with `tf.where`: the split into hits and misses has data-dependent
    shapes, which on a GPU cost round trips to the host (`Where`, `DynamicStitch`), while
    decompressing the hits too is cheap there.
    """
    if cache_ids is None:
        return compute_rows(ids)
    size = tf.shape(cache_ids, out_type=tf.int64)[0]
    position = tf.searchsorted(cache_ids, ids, side="left", out_type=tf.int64)
    position = tf.minimum(position, tf.maximum(size - 1, 0))
    hit = tf.equal(tf.gather(cache_ids, position), ids)  # empty slots never match an id
    if xla or _common.gpus_visible():
        cached = _read_rows(cache_rows, position)
        return tf.where(hit[:, None], cached, compute_rows(ids))
    hit_at = tf.cast(tf.where(hit)[:, 0], tf.int32)
    miss_at = tf.cast(tf.where(~hit)[:, 0], tf.int32)
    cached = _read_rows(cache_rows, tf.gather(position, hit_at))
    computed = compute_rows(tf.gather(ids, miss_at))
    return tf.dynamic_stitch([hit_at, miss_at], [cached, computed])


# ----------------------------------------------------------------------------------------
# Bags of all tables in one CSR.


class _TableBags(NamedTuple):
    bags: Any  # _bags.Bags over all tables' bags
    table_splits: tf.Tensor  # [num_tables + 1] int64: entries of each table
    finish: Any  # [num_bags, D] -> the output in the caller's layout


def _entry_tables(table_splits: tf.Tensor, nnz: tf.Tensor, num_tables: int) -> tf.Tensor:
    positions = tf.range(nnz, dtype=tf.int64)
    if num_tables == 1:
        return tf.zeros_like(positions)
    return tf.searchsorted(table_splits[1:], positions, side="right", out_type=tf.int64)


def _table_bags(
    indices: Any, weights: Any, num_tables: int, dtype: tf.DType, xla: bool
) -> _TableBags:
    """Converts the ids of one or several tables to one CSR batch."""
    if isinstance(indices, (list, tuple)):
        _args.check_table_lists(indices, weights, num_tables)
        return _list_bags(list(indices), weights, num_tables, dtype, xla)
    if num_tables > 1 and isinstance(indices, (tf.RaggedTensor, tf.SparseTensor)):
        raise ValueError(
            f"with num_tables = {num_tables}, ragged or sparse indices must be a list of "
            f"{num_tables} tensors (one per table), got one {type(indices).__name__}"
        )
    bags = _bags.to_csr(indices, weights, dtype, xla)
    ids_shape = tf.shape(bags.ids, out_type=tf.int64)
    with _common.on_host(xla):
        nnz = ids_shape[0]
        if num_tables == 1:
            table_splits = tf.stack([tf.constant(0, tf.int64), nnz])
    if num_tables > 1:
        rank = bags.static_batch_shape.rank
        leading = bags.static_batch_shape[0] if rank else None
        if rank is not None and rank < 1:
            raise ValueError(
                f"with num_tables = {num_tables}, dense indices must be [num_tables, ..., L], "
                f"got shape {bags.static_batch_shape.concatenate([None])}"
            )
        if leading is not None and leading != num_tables:
            raise ValueError(
                f"dense indices must be [num_tables = {num_tables}, ..., L], got a leading "
                f"dimension of {leading}"
            )
        checks = []
        if leading is None:
            same = tf.debugging.assert_equal(
                bags.batch_shape[0],
                tf.constant(num_tables, tf.int64),
                message=f"dense indices must be [num_tables = {num_tables}, ..., L]",
            )
            checks = [same] if same is not None else []
        with tf.control_dependencies(checks), _common.on_host(xla):
            per_table = nnz // num_tables
            table_splits = tf.range(num_tables + 1, dtype=tf.int64) * per_table

    def finish(output: tf.Tensor) -> tf.Tensor:
        if bags.batch_shape is not None:
            output = tf.reshape(
                output, tf.concat([bags.batch_shape, tf.shape(output, out_type=tf.int64)[1:]], 0)
            )
        output.set_shape(bags.static_batch_shape.concatenate(output.shape[-1:]))
        return output

    return _TableBags(bags, table_splits, finish)


def _list_bags(indices: list, weights: Any, num_tables: int, dtype: tf.DType, xla: bool):
    joined = _bags.concat_bags(
        indices,
        None if weights is None else list(weights),
        dtype,
        xla,
        "table",
        host=_common.on_host(xla),
    )
    bags, counts, static_bags = joined.bags, joined.counts, joined.static_batch

    def finish(output: tf.Tensor) -> tf.Tensor:
        output = tf.reshape(
            output, tf.stack([num_tables, counts[0], tf.shape(output, out_type=tf.int64)[1]])
        )
        output.set_shape([num_tables, static_bags, output.shape[-1]])
        return output

    return _TableBags(bags, joined.part_splits, finish)


# ----------------------------------------------------------------------------------------
# The two implementations.


def _global_ids(ids64, valid, table_splits, shape: TTShape) -> tf.Tensor:
    """Global id (table * P + id) of each entry, -1 where not `valid`."""
    nnz = tf.shape(ids64, out_type=tf.int64)[0]
    tables = _entry_tables(table_splits, nnz, shape.num_tables)
    return tf.where(valid, tables * shape.rows_per_table + ids64, tf.constant(-1, tf.int64))


def _count(frequency_table, global_ids: tf.Tensor, xla: bool) -> list:
    """Adds the batch's global ids (negative = skip) to the frequency table (TTCacheCount)."""
    if frequency_table is None:
        return []
    if xla:
        raise ValueError(
            "frequency counting (TTCacheCount, a cache layer's training-mode call) cannot "
            "run under XLA (jit_compile=True) or on TPU: call the layer with training=False "
            "there, or outside the compiled function"
        )
    lib = _tt_library("custom_op")
    if not hasattr(lib, "tf_ttemb_tt_cache_count"):
        raise _loader.OpLibraryNotFoundError(
            "The op library has no TTCacheCount op: rebuild it with `bash configure.sh`."
        )
    keys, counts = (_common.resource_variable(v) for v in frequency_table)
    if keys is None or counts is None:
        raise ValueError("frequency_table must be a pair of int64 variables (keys, counts)")
    op = lib.tf_ttemb_tt_cache_count(keys.handle, counts.handle, global_ids)
    return [op] if op is not None else []


def _custom_op_path(cores, table_bags, shape, padding_id, combiner, cache, frequency_table):
    lib = _tt_library("custom_op")
    bags = table_bags.bags
    unique_ids, slots = lib.tf_ttemb_tt_unique_ids(
        bags.ids,
        table_bags.table_splits,
        num_embeddings=shape.num_embeddings,
        stride=shape.rows_per_table,
        padding_id=-1 if padding_id is None else padding_id,
        has_padding_id=padding_id is not None,
    )
    counted = []
    if frequency_table is not None:
        with tf.control_dependencies([unique_ids]):  # counted once the ids are checked
            valid = tf.greater_equal(slots, 0)
            global_ids = _global_ids(
                tf.cast(bags.ids, tf.int64), valid, table_bags.table_splits, shape
            )
        counted = _count(frequency_table, global_ids, False)
    bags = bags._replace(ids=slots)
    if cache[0] is None and combiner != "max" and not _common.gpus_visible():
        return _bags_with_fused_grad(lib, cores, unique_ids, bags, shape, combiner, counted)
    rows = rows_with_cache(
        unique_ids,
        lambda ids: _custom_rows(lib, cores, ids, shape, ids_checked=True),
        *cache,
        xla=False,
    )
    with tf.control_dependencies(counted):
        rows = tf.identity(rows)
    return _custom_op.custom_op(rows, bags, combiner, None if padding_id is None else -1, True)


def _bags_with_fused_grad(lib, cores, unique_ids, bags, shape, combiner, counted):
    """The bags over `TTRows`' rows, with the cores' gradients from `TTRowsBagsGrad`.

    It sums each unique id's row gradient from the bags' output gradient where the TT
    backward reads it, instead of writing the rows' gradient [U, D]
    (`GatherReduceSumDenseGrad`) for `TTRowsGrad` to read back: one op and one pass over
    [U, D] less per step. CPU only (no GPU kernel), and not for max, whose gradient
    follows the forward's argmax. Padding entries are slot -1.
    """
    cores = [tf.convert_to_tensor(c) for c in cores]
    has_weights = bags.weights is not None
    attrs = _custom_op.op_attrs(combiner, has_weights, -1)
    weights = bags.weights if has_weights else _common.empty(cores[0].dtype, cores[0].device)
    ids, row_splits = bags.ids, bags.row_splits

    @tf.custom_gradient
    def forward(weights, *cores):
        # stop_gradient: the gradient below replaces the ops' registered ones.
        rows = _custom_rows(
            lib, [tf.stop_gradient(c) for c in cores], unique_ids, shape, ids_checked=True
        )
        with tf.control_dependencies(counted):
            rows = tf.identity(rows)
        weights_in = tf.stop_gradient(weights)
        output, _ = _custom_op.run_forward(lib, rows, ids, row_splits, weights_in, attrs)

        def grad(dy):
            indices, values = lib.tf_ttemb_tt_rows_bags_grad(
                unique_ids,
                list(cores),
                dy,
                ids,
                row_splits,
                weights_in,
                combiner=combiner,
                has_weights=has_weights,
                **shape.op_attrs(),
            )
            core_grads = [
                tf.IndexedSlices(v, i, dense_shape=tf.shape(c, out_type=tf.int64))
                for i, v, c in zip(indices, values, cores)
            ]
            weights_grad = None
            if has_weights:
                weights_grad = lib.tf_ttemb_gather_reduce_sum_weights_grad(
                    dy, rows, ids, row_splits, weights_in, output, **attrs
                )
            return [weights_grad] + core_grads

        return output, grad

    return forward(weights, *cores)


def _composite_path(cores, table_bags, shape, padding_id, combiner, cache, frequency_table, xla):
    cores = _shape_checked_cores(cores, shape, xla)
    bags = table_bags.bags
    ids64 = tf.cast(bags.ids, tf.int64)
    num_rows = tf.constant(shape.num_embeddings, tf.int64)
    checks = [] if xla else _bags.bounds_check(ids64, num_rows, padding_id)
    with tf.control_dependencies(checks):
        ids64 = tf.identity(ids64)
    valid = (ids64 >= 0) & (ids64 < num_rows)
    if padding_id is not None:
        valid &= tf.not_equal(ids64, padding_id)
    global_ids = _global_ids(ids64, valid, table_bags.table_splits, shape)
    counted = _count(frequency_table, global_ids, xla)
    if xla:
        # Every entry is its own slot (tf.unique does not compile); padding and
        # out-of-range ids read row 0 and are dropped by the reducer (slot -1).
        unique_ids = tf.maximum(global_ids, 0)
        slots = tf.where(valid, tf.range(tf.size(ids64, out_type=tf.int64)), -1)
    else:
        unique_ids = tf.sort(tf.unique(tf.boolean_mask(global_ids, valid)).y)
        slots = tf.where(
            valid,
            tf.searchsorted(unique_ids, global_ids, side="left", out_type=tf.int64),
            tf.constant(-1, tf.int64),
        )
    # One extra row (of id 0) that no slot uses: the reducer gathers a row for padding
    # entries too (then drops it), so the rows must not be empty.
    unique_ids = tf.concat([unique_ids, tf.zeros([1], tf.int64)], 0)
    rows = rows_with_cache(
        unique_ids, lambda ids: _composite_rows(cores, ids, shape), *cache, xla=xla
    )
    with tf.control_dependencies(counted):
        rows = tf.identity(rows)
    return composite.composite_with_gradient(
        rows,
        bags._replace(ids=tf.cast(slots, bags.ids.dtype)),
        combiner,
        -1,
        dense_grad=True,
        xla=xla,
    )


def _check_cache(cache_ids: Any, cache_rows: Any, dtype: tf.DType, dim: int) -> tuple:
    if (cache_ids is None) != (cache_rows is None):
        raise ValueError("cache_ids and cache_rows must be given together (or neither)")
    if cache_ids is None:
        return None, None
    if _common.resource_variable(cache_ids) is None:
        cache_ids = tf.convert_to_tensor(cache_ids)
    ids_dtype = tf.as_dtype(cache_ids.dtype)
    if ids_dtype != tf.int64:
        raise TypeError(f"cache_ids must be int64, got {ids_dtype.name}")
    if _common.resource_variable(cache_rows) is None:
        cache_rows = tf.convert_to_tensor(cache_rows)
    if tf.as_dtype(cache_rows.dtype) != dtype:
        raise TypeError(
            f"cache_rows must have the cores' dtype {dtype.name}, got "
            f"{tf.as_dtype(cache_rows.dtype).name}"
        )
    ids_shape, rows_shape = tf.TensorShape(cache_ids.shape), tf.TensorShape(cache_rows.shape)
    if not rows_shape.is_compatible_with([ids_shape[0] if ids_shape.rank else None, dim]):
        raise ValueError(
            f"cache_rows must be [C, D] = [{ids_shape[0] if ids_shape.rank else None}, {dim}] "
            f"for cache_ids {ids_shape}, got {rows_shape}"
        )
    if ids_shape.rank != 1:
        raise ValueError(f"cache_ids must be a vector [C], got shape {ids_shape}")
    if ids_shape[0] == 0:
        return None, None  # an empty cache holds nothing
    return tf.convert_to_tensor(cache_ids), cache_rows


# ----------------------------------------------------------------------------------------
# Public API.


def tt_embedding_bag(
    cores: Sequence,
    indices: IndicesLike,
    weights: Any = None,
    *,
    num_embeddings: int,
    p_shapes: Sequence[int],
    q_shapes: Sequence[int],
    ranks: Sequence[int],
    num_tables: int = 1,
    combiner: str = "sum",
    padding_id: int | None = None,
    cache_ids: Any = None,
    cache_rows: Any = None,
    frequency_table: tuple | None = None,
    implementation: str = "auto",
    name: str | None = None,
) -> tf.Tensor:
    """Combines bags of rows of a TT-compressed table (or several tables in one call).

    The result equals `tf_ttemb.gather_reduce_sum(table, indices, weights, combiner,
    padding_id)` with `table` the decompressed [N, D] table, but only the distinct rows of
    the batch are decompressed and neither the table nor the gathered [nnz, D] rows are
    built (the composite implementation under XLA builds the rows of every entry).

    Gradients: w.r.t. each core a `tf.IndexedSlices` over the core rows the batch touches
    (deterministic with the custom op); w.r.t. `cache_rows` an `IndexedSlices` over the
    cache slots hit; w.r.t. `weights` as in `gather_reduce_sum`; none w.r.t. ids.

    Args:
      cores: The T cores, tensors or variables; core k is
        `[num_tables * p_k, r_k * q_k * r_{k+1}]` (row d is the block G_k[d] of shape
        (r_k, q_k, r_{k+1}), row-major). float16, bfloat16, float32 or float64, one dtype.
      indices: Row ids in [0, num_embeddings), int32 or int64. One table: a dense tensor
        [..., L] (output [..., D]), a `tf.RaggedTensor` [B, (L)] or a 2-D
        `tf.SparseTensor` [B, L] (output [B, D]). Several tables: a dense tensor
        [num_tables, ..., L] (output [num_tables, ..., D]) or a list of num_tables
        ragged, sparse or dense [B, L] tensors with the same B (output [num_tables, B, D]).
      weights: Optional per-entry weights with the structure of `indices` (a list for a
        list of indices).
      num_embeddings: N, the rows of each table; ids outside [0, N) (even in
        [N, prod(p_shapes))) raise.
      p_shapes: Row factors [p_0, ..., p_{T-1}], prod >= N.
      q_shapes: Column factors, prod = D.
      ranks: Inner TT ranks [r_1, ..., r_{T-1}].
      num_tables: Number of tables stored in the cores (table t uses core rows
        t * p_k ... (t + 1) * p_k - 1).
      combiner: "sum", "mean", "sqrtn" or "max" (max takes no weights).
      padding_id: Entries with this id contribute nothing and are not counted.
      cache_ids: Optional sorted int64 [C] global ids (table * prod(p) + id) of cached
        rows, `2**63 - 1` for an empty slot.
      cache_rows: [C, D] rows of the cached ids (a tensor or a variable), used instead of
        the cores' value for those ids.
      frequency_table: Optional pair of int64 variables (keys [H], counts [H]): the
        global ids of the batch's non-padding entries are counted into it with
        `TTCacheCount` (needs the op library; not under XLA).
      implementation: "custom_op", "composite" (plain TensorFlow ops; compiles under XLA)
        or "auto" (the composite under XLA / on TPU, the custom op otherwise).
      name: Optional name scope.

    Returns:
      The combined rows, the cores' dtype (half types accumulate in float32).

    Raises:
      ValueError: Malformed factorisation, cores, cache or indices, quoting the values.
      tf.errors.InvalidArgumentError: An id outside [0, num_embeddings) that is not
        `padding_id`: `indices[17] = 9001 is not in [0, 4096)` (flat position, over the
        concatenated tables for a list). Under XLA such ids contribute zero instead.

    Example:

    >>> import numpy as np
    >>> import tensorflow as tf
    >>> from tf_ttemb.ops.tt_embedding import tt_embedding_bag
    >>> rng = np.random.default_rng(0)
    >>> # A 12 x 6 table: p = [3, 4], q = [2, 3], rank 2.
    >>> cores = [tf.constant(rng.normal(size=(3, 1 * 2 * 2))),
    ...          tf.constant(rng.normal(size=(4, 2 * 3 * 1)))]
    >>> ids = tf.ragged.constant([[0, 11, 11], [], [5]])
    >>> out = tt_embedding_bag(cores, ids, num_embeddings=12, p_shapes=[3, 4],
    ...                        q_shapes=[2, 3], ranks=[2], combiner="mean",
    ...                        implementation="composite")
    >>> out.shape
    TensorShape([3, 6])
    """
    padding_id = _common.check_lookup_args(combiner, weights, padding_id, implementation)
    shape = check_shapes(num_embeddings, p_shapes, q_shapes, ranks, num_tables)
    with tf.name_scope(name or "tt_embedding_bag"):
        cores = _check_cores(cores, shape)
        dtype = tf.as_dtype(cores[0].dtype)
        cache = _check_cache(cache_ids, cache_rows, dtype, shape.dim)
        implementation, xla = _choose(implementation, cores[0])
        table_bags = _table_bags(indices, weights, shape.num_tables, dtype, xla)
        if implementation == "custom_op":
            output = _custom_op_path(
                cores, table_bags, shape, padding_id, combiner, cache, frequency_table
            )
        else:
            output = _composite_path(
                cores, table_bags, shape, padding_id, combiner, cache, frequency_table, xla
            )
        output.set_shape([None, shape.dim])
        return table_bags.finish(output)


def tt_rows(
    cores: Sequence,
    ids: Any,
    *,
    p_shapes: Sequence[int],
    q_shapes: Sequence[int],
    ranks: Sequence[int],
    num_tables: int = 1,
    implementation: str = "auto",
    name: str | None = None,
) -> tf.Tensor:
    """Decompresses the rows of given global ids (e.g. a table, a chunk at a time).

    Args:
      cores: The T cores, as for `tt_embedding_bag`.
      ids: Global ids [n] (`table * prod(p_shapes) + row`), any integer dtype, any order,
        duplicates allowed; each in [0, num_tables * prod(p_shapes)).
      p_shapes, q_shapes, ranks, num_tables: The factorisation, as for `tt_embedding_bag`.
      implementation: "custom_op" (`TTRows`), "composite" or "auto".
      name: Optional name scope.

    Returns:
      The rows [n, D] in the cores' dtype; differentiable w.r.t. the cores.

    Raises:
      tf.errors.InvalidArgumentError: `ids[3] = 99 is not in [0, 96)` (raised eagerly and
        in graphs; under XLA the composite clamps instead).

    Example:

    >>> import numpy as np
    >>> import tensorflow as tf
    >>> from tf_ttemb.ops.tt_embedding import tt_rows
    >>> cores = [tf.ones([3, 4]), tf.ones([4, 6])]
    >>> tt_rows(cores, tf.constant([0, 11]), p_shapes=[3, 4], q_shapes=[2, 3],
    ...         ranks=[2], implementation="composite").numpy()
    array([[2., 2., 2., 2., 2., 2.],
           [2., 2., 2., 2., 2., 2.]], dtype=float32)
    """
    shape = check_shapes(1, p_shapes, q_shapes, ranks, num_tables)
    with tf.name_scope(name or "tt_rows"):
        cores = _check_cores(cores, shape)
        implementation, xla = _choose(implementation, cores[0])
        ids = tf.convert_to_tensor(ids)
        if ids.shape.rank is not None and ids.shape.rank != 1:
            raise ValueError(f"ids must be a vector [n], got shape {ids.shape}")
        ids = tf.cast(_common.int_ids(ids, "ids"), tf.int64)
        if implementation == "custom_op":
            return _custom_rows(_tt_library(implementation), cores, ids, shape)
        limit = shape.num_tables * shape.rows_per_table
        if xla:
            ids = tf.clip_by_value(ids, 0, limit - 1)
        else:
            checks = _check_ids(ids, limit)
            with tf.control_dependencies(checks):
                ids = tf.identity(ids)
        return _composite_rows(_shape_checked_cores(cores, shape, xla), ids, shape)


def _check_ids(ids: tf.Tensor, limit: int) -> list:
    """`ids[j] = v is not in [0, M)` (as TTRows), eagerly or as a graph assert."""
    bad = (ids < 0) | (ids >= limit)

    def first_bad():
        position = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
        return position, ids[position]

    if tf.executing_eagerly():
        if bool(tf.reduce_any(bad)):
            position, value = first_bad()
            raise tf.errors.InvalidArgumentError(
                None, None, f"ids[{int(position)}] = {int(value)} is not in [0, {limit})"
            )
        return []

    def fail():
        position, value = first_bad()
        message = tf.strings.join(
            [
                "ids[",
                tf.strings.as_string(position),
                "] = ",
                tf.strings.as_string(value),
                f" is not in [0, {limit})",
            ]
        )
        with tf.control_dependencies([tf.debugging.Assert(False, [message])]):
            return tf.constant(False)

    return [tf.cond(tf.reduce_any(bad), fail, lambda: tf.constant(True))]
